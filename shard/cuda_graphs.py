"""Decode forwards captured as CUDA graphs, one per batch-size bucket.

A decode step of a large model launches hundreds of small kernels; launched one by one
from Python the GPU waits on the host. At warm-up the whole decode forward (embedding →
layers with attention → final norm → LM head) is captured once per bucket
(``torch.cuda.CUDAGraph``, see PyTorch's "CUDA Graphs" notes); a step copies its inputs
into the static buffers and replays the smallest bucket that holds the batch.

Padded rows (bucket size minus batch size) get slot -1, so they never write a real KV
slot, and a context of one token in the first block of their table row (a valid block
id), which is read and ignored. One kernel fills the static inputs of a step
(:mod:`shard.kernels.decode_inputs`).

The attention backend's per-step ``prepare`` runs inside the captured region, so a
replay repeats its device work on the new inputs (graph-safe backends do no host work
there; see :meth:`~shard.attention.base.AttentionBackend.prepare`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from loguru import logger

from shard.attention.base import AttentionBackend
from shard.attention.metadata import AttentionMetadata
from shard.decode_state import DecodeRows
from shard.kernels.choices import KernelChoices
from shard.kernels.decode_inputs import fill_decode_inputs_torch
from shard.models.base import CausalLM


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch_size``."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    buckets += list(range(16, max_batch_size, 16))
    return sorted({*buckets, max_batch_size})


def parse_buckets(spec: str, max_batch_size: int) -> list[int]:
    """``--cuda-graphs`` value → sorted bucket sizes.

    ``"auto"``: :func:`default_buckets`; ``"0"`` or ``""``: none (eager decode);
    otherwise comma-separated sizes, e.g. ``"1,2,4,8,16,32"`` (TGI's spelling); sizes
    above ``max_batch_size`` are dropped.

    Raises:
        ValueError: a size that is not a positive integer (names the flag).
    """
    spec = spec.strip()
    if spec in ("", "0"):
        return []
    if spec == "auto":
        return default_buckets(max_batch_size)
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--cuda-graphs must be 'auto', '0' or comma-separated batch sizes, got {spec!r}"
        ) from None
    if any(size <= 0 for size in sizes):
        raise ValueError(f"--cuda-graphs batch sizes must be positive, got {spec!r}")
    return [size for size in sizes if size <= max_batch_size]


def graph_buckets(spec: str, max_batch_size: int, device: torch.device,
                  backend: AttentionBackend, log: Any = logger) -> list[int]:
    """Batch sizes whose decode runs as a CUDA graph: ``--cuda-graphs`` (``spec``, see
    :func:`parse_buckets`) up to ``max_batch_size``; none off CUDA, with graphs off, or
    with a backend that cannot run inside a graph (then a warning on ``log``).

    Raises:
        ValueError: a malformed ``spec`` (names the flag).
    """
    if device.type != "cuda" or max_batch_size <= 0:
        return []
    buckets = parse_buckets(spec, max_batch_size)
    if buckets and not backend.cuda_graph_safe:
        log.warning("decode runs eagerly: attention backend {} cannot run in a CUDA graph",
                    backend.name)
        return []
    return buckets


class DecodeGraphs:
    """Captured decode forwards over shared static buffers.

    Args:
        model: the causal LM (``model(input_ids, positions, metadata)`` and
            ``compute_logits``).
        backend: the model's attention backend (one that declares ``cuda_graph_safe``).
        buckets: batch sizes to capture, e.g. [1, 2, 4, 8, 16, ...].
        block_size: tokens per KV block.
        max_seqlen_k: the longest context a request can reach (max_total_tokens); the
            attention kernels are launched for it (their split count depends on it).
        device: the CUDA device.
        kernels: the runner's kernel choices (PDL of the input-filling kernel).

    The KV cache must be bound before :meth:`capture` (its addresses are recorded in
    the graphs); capture again after binding another cache.
    """

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        buckets: Sequence[int],
        block_size: int,
        max_seqlen_k: int,
        device: torch.device,
        kernels: KernelChoices | None = None,
    ) -> None:
        assert buckets, "no batch-size buckets"
        assert backend.cuda_graph_safe, f"attention backend {backend.name} is not graph-safe"
        self.model = model
        self.backend = backend
        self.buckets = sorted(buckets)
        self.block_size = block_size
        self.max_seqlen_k = max_seqlen_k
        self.device = device
        self.kernels = kernels if kernels is not None else KernelChoices()
        size = self.buckets[-1]
        width = -(-max_seqlen_k // block_size)
        # static inputs: [max bucket] (block_tables [max bucket, width]); bucket b uses [:b]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, width, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.cu_seqlens_k = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._fill: Callable[..., None] = fill_decode_inputs_torch

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket holding ``batch`` rows, or None."""
        for bucket in self.buckets:
            if bucket >= batch:
                return bucket
        return None

    def _forward(self, bucket: int) -> torch.Tensor:
        """The captured region: inputs from the static buffers → logits [bucket, vocab]
        in the model's dtype (the samplers cast what they need: the greedy kernel reads
        bfloat16 as it is, so a greedy step writes and reads no float32 copy)."""
        seq_lens = self.seq_lens[:bucket]
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=self.cu_seqlens_k[1 : bucket + 1])
        metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bucket],
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            cu_seqlens_k=self.cu_seqlens_k[: bucket + 1],
            seq_lens=seq_lens,
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            has_skipped_slots=True,
        )
        self.backend.prepare(metadata)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], metadata)
        return self.model.compute_logits(hidden, dtype=None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool.

        NOTE: each bucket first runs once eagerly (Triton compiles its kernels, cuBLAS
        picks its algorithms) on a side stream, as capture requires.
        """
        self.release()
        self._pick_fill()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self._forward(bucket)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[bucket] = self._forward(bucket)
                pool = graph.pool()
                self._graphs[bucket] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop the graphs and their memory pool (before the KV cache is replaced)."""
        self._graphs.clear()
        self._logits.clear()

    def _pick_fill(self) -> None:
        """Use the one-kernel input fill (:func:`fill_decode_inputs`) where it runs, the
        torch ops otherwise; its first call, here, fills every row as padding."""
        empty = DecodeRows(
            tokens=self.input_ids[:0], seq_lens=self.seq_lens[:0],
            block_tables=self.block_tables[:0],
        )
        try:
            from shard.kernels.decode_inputs import fill_decode_inputs

            self._fill = fill_decode_inputs
            self._fill_inputs(empty, len(self.input_ids))
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # no Triton, or a compile error (not a RuntimeError)
            logger.warning("decode input kernel unavailable, using torch ops: {}: {}",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self._fill = fill_decode_inputs_torch
            self._fill_inputs(empty, len(self.input_ids))

    def _fill_inputs(self, rows: DecodeRows, bucket: int) -> None:
        """Rows ``[:bucket]`` of the static inputs from ``rows`` (padding after them)."""
        self._fill(rows.tokens, rows.seq_lens, rows.block_tables, self.block_size,
                   self.input_ids[:bucket], self.positions[:bucket], self.seq_lens[:bucket],
                   self.slot_mapping[:bucket], self.block_tables, pdl=self.kernels.pdl)

    def replay(self, batch: int) -> None:
        """Replay the graph of ``batch``'s bucket on the static inputs as they are (what
        the last :meth:`run` left): for benchmarks that time the captured forward alone.

        Raises:
            ValueError: no captured bucket holds the batch.
        """
        bucket = self.bucket_for(batch)
        if bucket is None or bucket not in self._graphs:
            raise ValueError(f"no CUDA graph captured for a batch of {batch}")
        self._graphs[bucket].replay()

    def holds(self, batch: int, max_seqlen_k: int) -> bool:
        """Whether a captured graph runs a decode of ``batch`` rows whose longest
        context after the step is ``max_seqlen_k`` tokens."""
        return self.bucket_for(batch) is not None and max_seqlen_k <= self.max_seqlen_k

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """One decode forward of ``rows`` by graph replay.

        Returns:
            logits [len(rows), vocab] in the model's dtype (a view of the graph's
            output buffer, valid until the next replay).

        The rows' contexts after this step must fit ``max_seqlen_k`` (the caller
        checks); block-table columns beyond it are never read, so a table grown wider
        (tables widen by doubling) is copied only up to the captured width.

        Raises:
            ValueError: no captured bucket holds the batch.
        """
        n = len(rows)
        bucket = self.bucket_for(n)
        if bucket is None or bucket not in self._graphs:
            raise ValueError(f"no CUDA graph captured for a batch of {n}")
        self._fill_inputs(rows, bucket)
        self._graphs[bucket].replay()
        return self._logits[bucket][:n]

