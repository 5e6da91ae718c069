"""Warm-up: the KV cache sized and allocated, products tuned, the worst-case prefill
run through the cache and the decode CUDA graphs captured, before a shard serves
(:class:`Warmup`, run by :meth:`shard.model_runner.ModelRunner.warmup`), and the pieces
of it that need no model: the worst-case prefill, the KV budget from a measured memory
profile, and the check that the cache holds the budgets.

CPU: ``num_blocks = kv_cache_bytes // bytes_per_block``.
CUDA: run the worst-case prefill with a temporary cache just big enough for it,
measure peak memory, then give the KV cache what is left of
``total × gpu_memory_fraction`` (the vLLM profiling approach).
Either way the real cache is then allocated and the worst-case prefill runs through it.
Blocks are counted in the cache's own dtype (``--kv-cache-dtype``): an fp8 block, with its
scales, takes about half the bytes of a bfloat16 one, so the same budget holds about
twice the tokens (see :mod:`shard.kv_cache`).
With decode CUDA graphs, their memory pool is measured by a capture over the temporary
cache and left out of the KV budget; the graphs are captured again over the real cache.
Each of these phases is announced (see shard/progress.py): warm-up can take tens of
seconds on a GPU and must not look like a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shard.cuda_graphs import DecodeGraphs, graph_buckets
from shard.errors import KVCacheTooSmallError
from shard.inputs import SeqChunk
from shard.kernels import fp8_tuning, gemm_tuning, tuning_cache
from shard.kernels.compile_watch import WATCH
from shard.kv_cache import KVCacheLayer, allocate_kv_cache, bytes_per_block
from shard.layers.product_weights import fp8_linear_weights, linear_weights, lm_head_weights
from shard.layers.tp_layout import kv_heads_per_rank
from shard.progress import PhaseProgress
from shard.quantization.config import resolve_kv_cache_dtype
from shard.sampling import SamplingRow, sample, sample_greedy
from shard.sampling_types import SamplingParams

if TYPE_CHECKING:
    from shard.model_runner import ModelRunner

# Phases shown while warming up (log lines, and a bar on rank 0's terminal).
WARMUP_PHASES = 3  # plus one for the decode CUDA graphs when there are any


def dummy_chunks(
    max_batch_prefill_tokens: int, max_total_tokens: int, block_size: int
) -> list[SeqChunk]:
    """Worst-case prefill: ``max_batch_prefill_tokens`` tokens split into sequences of at
    most ``max_total_tokens``, all on the same consecutive blocks from block 0.

    NOTE: the sequences share their blocks: the warm-up measures the prefill's memory
    and compiles its kernels, whatever their results, so the cache needs the longest
    sequence's blocks, not the whole step's (at serving time a step never computes more
    tokens than the blocks the router gave out)."""
    chunks = []
    remaining = max_batch_prefill_tokens
    while remaining > 0:
        n = min(remaining, max_total_tokens)
        chunks.append(SeqChunk([0] * n, 0, list(range(-(-n // block_size)))))
        remaining -= n
    return chunks


# (prompt tokens, cached prefix) of each sequence of the steps warm-up runs beside the
# worst-case prefill: one token, a count that is not a multiple of 16, several sequences
# over prefixes of odd lengths, and 16 and 17 one-token sequences. Triton compiles a
# variant of a kernel per integer argument that is 1, a multiple of 16 or neither
# (shard/kernels/compile_watch.py), and a step's token count reaches kernels as one (the
# skinny products' M); the worst-case prefill's sizes are multiples of 16.
ODD_SHAPES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((1, 0),),
    ((17, 0),),
    ((5, 0), (3, 7), (1, 33), (24, 40)),
    tuple((1, 8 + i) for i in range(16)),
    tuple((1, 8 + i) for i in range(17)),
)


def odd_shapes(first: SeqChunk) -> list[list[SeqChunk]]:
    """The steps of :data:`ODD_SHAPES` over ``first``'s tokens and block table (those
    that fit in it)."""
    steps = []
    for shape in ODD_SHAPES:
        if max(n + start for n, start in shape) > len(first.token_ids):
            continue
        steps.append([SeqChunk(first.token_ids[start:start + n], start, first.block_table)
                      for n, start in shape])
    return steps


def blocks_needed(chunks: list[SeqChunk]) -> int:
    """KV blocks the worst-case prefill ``chunks`` write (they share theirs)."""
    return max(len(c.block_table) for c in chunks)


def dummy_sampling_rows(num_rows: int) -> list[SamplingRow]:
    """Sampling of the worst-case prefill: top-p, top-k and top-n logprobs, so every
    sampler path is allocated for."""
    return [
        SamplingRow(SamplingParams(do_sample=True, top_p=0.9, top_k=50), top_n=5)
        for _ in range(num_rows)
    ]


@dataclass(frozen=True)
class MemoryProfile:
    """What the CUDA warm-up measured, all in bytes.

    Attributes:
        total: the device's memory.
        peak: most memory PyTorch allocated during the worst-case prefill, the
            temporary KV cache included.
        non_torch: memory in use outside PyTorch's allocator (CUDA context, NCCL).
        temp_cache: the temporary KV cache the prefill ran with.
        graphs: the decode CUDA graphs' memory pool (0 without graphs).
    """

    total: int
    peak: int
    non_torch: int
    temp_cache: int
    graphs: int

    def kv_budget(self, memory_fraction: float) -> int:
        """Bytes left for the KV cache within ``total × memory_fraction`` (>= 0)."""
        budget = (
            int(self.total * memory_fraction)
            - self.non_torch
            - (self.peak - self.temp_cache)
            - self.graphs
        )
        return max(budget, 0)

    def describe(self, memory_fraction: float) -> str:
        gib = 2**30
        return (
            f"memory: total {self.total / gib:.2f} GiB, warmup peak {self.peak / gib:.2f} GiB, "
            f"other {self.non_torch / gib:.2f} GiB, CUDA graphs {self.graphs / gib:.2f} GiB, "
            f"KV budget {self.kv_budget(memory_fraction) / gib:.2f} GiB"
        )


def check_kv_fits(
    num_blocks: int,
    chunks: list[SeqChunk],
    block_size: int,
    per_block: int,
    max_batch_prefill_tokens: int,
    max_total_tokens: int,
    memory_flag: str,
    hold_total: bool = True,
) -> None:
    """Raise unless ``num_blocks`` hold the worst-case prefill and, with ``hold_total``,
    one request of ``max_total_tokens``.

    Raises:
        KVCacheTooSmallError: naming ``memory_flag`` and the budget flags to change.
    """
    total_blocks = -(-max_total_tokens // block_size) if hold_total else 0
    need = max(blocks_needed(chunks), total_blocks)
    if num_blocks < need:
        budgets = f"max_batch_prefill_tokens={max_batch_prefill_tokens}"
        flags = "--max-batch-prefill-tokens"
        if hold_total:
            budgets += f" and max_total_tokens={max_total_tokens}"
            flags += " / --max-total-tokens"
        raise KVCacheTooSmallError(
            f"KV cache fits {num_blocks} blocks ({num_blocks * block_size} tokens, "
            f"{per_block} bytes per block) but warmup needs {need} blocks for "
            f"{budgets}: raise {memory_flag} or lower {flags}"
        )


class Warmup:
    """The warm-up of one runner (see the module doc): replaces its KV cache and decode
    graphs, and the process's tuned products.

    Args:
        runner: the runner to warm up; its model, backend, configuration and logger are
            used, its requests dropped.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.config = runner.config
        self.device = runner.device
        self.log = runner.log
        # the model's dtype, or fp8 (--kv-cache-dtype fp8)
        self.kv_dtype = resolve_kv_cache_dtype(self.config, runner.dtype, self.device)

    @torch.inference_mode()
    def run(self, max_batch_prefill_tokens: int, max_total_tokens: int, max_batch_size: int,
            hold_total: bool) -> int:
        """:meth:`shard.model_runner.ModelRunner.warmup` (its arguments, result and
        errors)."""
        runner = self.runner
        runner.reset()
        WATCH.install()
        WATCH.disarm()  # warm-up compiles
        self._unbind_kv_cache()  # a failed warmup leaves the shard without a cache
        buckets = graph_buckets(self.config.cuda_graphs, max_batch_size, self.device,
                                runner.backend, self.log)
        if max_batch_prefill_tokens <= 0 or max_total_tokens <= 0:
            raise ValueError("max_batch_prefill_tokens and max_total_tokens must be > 0")
        block_size = runner.block_size
        per_block = bytes_per_block(runner.model_config, block_size, self.kv_dtype,
                                    self.config.world_size)
        if runner.draft is not None:  # its cache has the same blocks
            per_block += runner.draft.bytes_per_block(self.kv_dtype)
        chunks = dummy_chunks(max_batch_prefill_tokens, max_total_tokens, block_size)
        tune = gemm_tuning.tunes(self.config, self.device, runner.dtype)
        with PhaseProgress("warm-up", WARMUP_PHASES + bool(buckets) + tune, self.log,
                           show_bar=self.config.rank == 0) as progress:
            if tune:
                progress.phase("timing cuBLASLt's algorithms for the products")
                self._tune_products(max_batch_prefill_tokens, buckets)
            if self.device.type == "cuda":
                self._tune_fp8_products(timed=tune)
                progress.phase(
                    f"profiling a worst-case prefill of {max_batch_prefill_tokens} tokens"
                    + (" and the decode CUDA graphs" if buckets else "")
                )
                num_blocks = self._profile_kv_blocks(chunks, per_block, buckets,
                                                     max_total_tokens)
                memory_flag = "--gpu-memory-fraction"
            else:
                progress.phase("sizing the KV cache (--kv-cache-bytes)")
                num_blocks = self.config.kv_cache_bytes // per_block
                memory_flag = "--kv-cache-bytes"
            check_kv_fits(num_blocks, chunks, block_size, per_block,
                          max_batch_prefill_tokens, max_total_tokens, memory_flag,
                          hold_total=hold_total)
            progress.phase(f"allocating the KV cache: {num_blocks} blocks of {block_size} tokens")
            self._bind_kv_cache(self._allocate_kv_cache(num_blocks))
            progress.phase("running the worst-case prefill through the cache")
            self._run_dummy_prefill(chunks, max_total_tokens)
            if buckets:
                progress.phase(f"capturing decode CUDA graphs for batch sizes up to {buckets[-1]}")
                started = time.perf_counter()
                self._capture_graphs(buckets, max_total_tokens)
                self.log.info("captured decode CUDA graphs for batch sizes {} in {:.1f} s",
                              list(buckets), time.perf_counter() - started)
        self.log.info("warmup done: {} KV blocks of {} tokens ({} bytes per block, {})",
                      num_blocks, block_size, per_block, self._describe_kv())
        WATCH.arm()
        return num_blocks

    def _tune_products(self, max_batch_prefill_tokens: int, buckets: Sequence[int]) -> None:
        """Time cuBLASLt's algorithms for the model's products at the prefill sizes and
        the decode graphs' batch sizes (:func:`shard.kernels.gemm_tuning.tune`) into the
        runner's GEMM table, skipping the products a fused kernel takes
        (:meth:`CausalLM.fused_decode_rows`)."""
        model = self.runner.model
        table = self.runner.kernels.gemms
        table.clear()
        gemm_tuning.tune(table, linear_weights(model), max_batch_prefill_tokens, self.log,
                         decode_rows=buckets, decode_weights=lm_head_weights(model),
                         cache=tuning_cache.cache_for(self.config, self.device, self.log),
                         decode_elsewhere=model.fused_decode_rows())

    def _tune_fp8_products(self, timed: bool) -> None:
        """Choose between our skinny kernel and ``torch._scaled_mm`` for each fp8 product
        of up to 16 rows: with ``timed`` by timing both
        (:func:`shard.kernels.fp8_tuning.tune`), else the kernel, run once here. A skinny
        kernel that fails here (e.g. does not compile on this GPU) is logged and dropped:
        every fp8 product then runs through ``torch._scaled_mm``."""
        kernels = self.runner.kernels
        layers = fp8_linear_weights(self.runner.model)
        kernels.fp8_gemms.clear()
        if not layers or kernels.skinny_fp8_linear is None:
            return
        try:
            if timed:
                fp8_tuning.tune(kernels.fp8_gemms, layers, kernels.skinny_fp8_linear,
                                gemm_tuning.SKINNY_ROWS, log=self.log)
            else:
                fp8_tuning.time_shape(1, layers[:1], kernels.skinny_fp8_linear,
                                      torch.bfloat16, reps=1)
        except Exception as exc:  # a compile error is not a RuntimeError
            self.log.warning("skinny fp8 kernel unavailable, fp8 products through "
                             "torch._scaled_mm: {}: {}", type(exc).__name__,
                             str(exc).splitlines()[0] if str(exc) else "")
            kernels.skinny_fp8_linear = None

    def _bind_kv_cache(self, kv_cache: list[KVCacheLayer]) -> None:
        """Attach one cache layer to each attention layer of the runner's model
        (replacing any previous cache), and a cache of as many blocks to the draft
        model's."""
        runner = self.runner
        if runner.draft is not None:
            runner.draft.bind(kv_cache[0].num_blocks, self.kv_dtype)
        layers = runner.model.attention_layers()
        assert len(layers) == len(kv_cache), (
            f"{len(layers)} attention layers, {len(kv_cache)} cache layers"
        )
        for attn, cache in zip(layers, kv_cache, strict=True):
            attn.kv_cache = cache
        runner.kv_cache = kv_cache

    def _unbind_kv_cache(self) -> None:
        """Detach and release the runner's KV cache (its num_blocks becomes 0) and the
        CUDA graphs that read it."""
        runner = self.runner
        if runner.graphs is not None:
            runner.graphs.release()
            runner.graphs = None
        for attn in runner.model.attention_layers():
            attn.kv_cache = None
        runner.kv_cache = []
        if runner.draft is not None:
            runner.draft.unbind()

    def _describe_kv(self) -> str:
        """What the KV cache holds, for the log."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return f"{str(self.kv_dtype).removeprefix('torch.')} keys and values"
        return ("fp8 KV cache: float8_e4m3fn keys and values, a float32 scale per token and "
                "KV head")

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCacheLayer]:
        runner = self.runner
        fp8 = self.kv_dtype == torch.float8_e4m3fn  # token-major only
        return allocate_kv_cache(runner.model_config, num_blocks, runner.block_size,
                                 self.kv_dtype, self.device, self.config.world_size,
                                 head_major=not fp8 and runner.backend.kv_head_major(self.device))

    def _run_dummy_prefill(self, chunks: list[SeqChunk], max_total_tokens: int) -> None:
        """The worst-case prefill and its sampling (both samplers), through the bound
        cache; then a few tokens of its first sequence again over the first half as a
        cached prefix, so that both prefill attention paths (prefix-free and over a
        cached prefix, which can be different kernels) are compiled and loaded before
        serving; then the steps of :func:`odd_shapes`, with their logits and greedy
        sampling, for the kernel variants their sizes select, and eager decode steps at
        the contexts the attention backend names (:meth:`~shard.attention.base.
        AttentionBackend.eager_decode_contexts`) up to the longest a sequence can reach,
        ``max_total_tokens`` (a sequence decodes past the longest prompt chunk, into
        contexts that may split more)."""
        runner = self.runner
        inputs, hidden = runner.run_chunks(chunks, is_prefill=True)
        logits = runner.model.compute_logits(hidden[inputs.last_token_indices])
        if runner.draft is not None:
            runner.draft.warm(chunks)
        sample(logits, dummy_sampling_rows(len(chunks)))
        # the greedy kernel is compiled (or found unusable) here, and for a decode graph's
        # logits (uncast)
        sample_greedy(logits, kernels=runner.kernels)
        if runner.dtype != logits.dtype:
            sample_greedy(logits.to(runner.dtype), kernels=runner.kernels)
        first = chunks[0]
        half = len(first.token_ids) // 2
        if half:
            tokens = first.token_ids[half:half + 16]
            runner.run_chunks([SeqChunk(tokens, half, first.block_table)], is_prefill=True)
        for shape in odd_shapes(first):
            inputs, hidden = runner.run_chunks(shape, is_prefill=True)
            logits = runner.model.compute_logits(hidden[inputs.last_token_indices])
            sample_greedy(logits, kernels=runner.kernels)
            if runner.draft is not None:
                runner.draft.warm(shape)
        # eager decode steps (a mixed step runs its decode rows so) at each context the
        # backend names: one per variant of its decode kernels
        kv_heads = kv_heads_per_rank(runner.model_config.num_key_value_heads,
                                     self.config.world_size)
        # every rank the same contexts (each decode step all-reduces), whatever its own
        # cache holds: the table wraps around the cache's blocks (their contents are dummy)
        table = [b % runner.num_blocks for b in range(-(-max_total_tokens // runner.block_size))]
        for context in runner.backend.eager_decode_contexts(kv_heads, max_total_tokens):
            runner.run_chunks([SeqChunk(first.token_ids[:1], context - 1, table)],
                              is_prefill=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _profile_kv_blocks(
        self, chunks: list[SeqChunk], per_block: int, buckets: Sequence[int],
        max_total_tokens: int,
    ) -> int:
        """KV blocks that fit ``--gpu-memory-fraction`` of the GPU, measured by running
        the worst-case prefill (and capturing the decode graphs) over a temporary cache
        just large enough for it; the temporary cache and graphs are released."""
        device = self.device
        temp_blocks = blocks_needed(chunks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        self._bind_kv_cache(self._allocate_kv_cache(temp_blocks))
        self._run_dummy_prefill(chunks, max_total_tokens)
        peak = torch.cuda.max_memory_allocated(device)
        graph_bytes = 0
        if buckets:
            before = torch.cuda.memory_reserved(device)
            self._capture_graphs(buckets, max_total_tokens)
            graph_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        free, total = torch.cuda.mem_get_info(device)
        non_torch = total - free - torch.cuda.memory_reserved(device)
        self._unbind_kv_cache()
        torch.cuda.empty_cache()
        profile = MemoryProfile(total, peak, non_torch, temp_blocks * per_block, graph_bytes)
        fraction = self.config.gpu_memory_fraction
        self.log.info("{}", profile.describe(fraction))
        return profile.kv_budget(fraction) // per_block

    def _capture_graphs(self, buckets: Sequence[int], max_total_tokens: int) -> None:
        """Capture the decode forward for ``buckets`` over the bound KV cache; the runner
        replays them from now on."""
        runner = self.runner
        graphs = DecodeGraphs(runner.model, runner.backend, buckets, runner.block_size,
                              max_total_tokens, self.device, runner.kernels)
        graphs.capture()
        runner.graphs = graphs
        if runner.draft is not None:
            runner.draft.capture(buckets, max_total_tokens)
