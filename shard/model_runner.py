"""The model runner: turns Prefill/Decode steps into tensors, runs the model,
samples, and updates the requests the shard holds (:class:`~shard.requests.RequestTable`).
Synchronous; the servicer calls it from a worker thread under a lock.

Entry points: :meth:`ModelRunner.info`, :meth:`~ModelRunner.warmup`,
:meth:`~ModelRunner.prefill`, :meth:`~ModelRunner.decode`, :meth:`~ModelRunner.reset`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from shard import step_trace
from shard.attention import AttentionSpec, select_backend
from shard.config import ShardConfig, default_cache_dir, dtype_name
from shard.cuda_graphs import DecodeGraphs, parse_buckets
from shard.decode_state import DecodeRows
from shard.distributed import init_distributed
from shard.errors import NotWarmedUpError
from shard.grammar import GrammarCompiler, GrammarMatcher, unpack_bitmask
from shard.host_copy import HostCopy, to_device
from shard.host_memory import retain_freed_memory
from shard.inputs import ModelInputs, SeqChunk, build_inputs
from shard.kv_cache import KVCacheLayer, allocate_kv_cache, bytes_per_block
from shard.layers import gemm_tuning
from shard.layers.linear import linear_weights, lm_head_weights
from shard.layers.tp_layout import check_tp_size, kv_heads_per_rank
from shard.model_loader import build_model
from shard.models.config import ModelConfig
from shard.models.llama import fused_decode_rows
from shard.pending_step import PendingStep, StepTimer
from shard.progress import PhaseProgress
from shard.records import (
    DecodeStep,
    Generation,
    NewRequest,
    PrefillStep,
    ShardInfo,
    StepOutput,
    TopToken,
)
from shard.requests import RequestState, RequestTable
from shard.sampling import (
    SamplerOutput,
    SamplingRow,
    TokenMask,
    TokenSuffix,
    sample,
    sample_greedy,
)
from shard.step_checks import validate_decode, validate_prefill
from shard.warmup import (
    WARMUP_PHASES,
    MemoryProfile,
    blocks_needed,
    check_kv_fits,
    dummy_chunks,
    dummy_sampling_rows,
)

# A Decode that changes nothing: every row steps as it is.
NO_CHANGE = DecodeStep()


def configure_pdl(mode: str, device: torch.device, log: Any) -> None:
    """Apply ``--pdl`` to this process's Triton kernels (:mod:`shard.pdl`); nothing to do
    off CUDA or without Triton, where none of them runs with it."""
    if device.type != "cuda":
        return
    try:
        from shard import pdl
    except ImportError:
        return
    pdl.configure(mode, device, log)


class ModelRunner:
    """Owns the model, the KV cache and the request rows of one shard.

    Args:
        config: shard configuration.

    Raises:
        ValueError: unsupported model/backend, or a world size that cannot split the
            model's heads (the message names the valid shard counts).
        RuntimeError: the tensor-parallel rendezvous failed (world_size > 1).
    """

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.log = logger.bind(rank=config.rank)
        self.device = config.torch_device()
        if self.device.type == "cuda":  # cuda:N: our kernels and libraries' calls go there
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu" and retain_freed_memory():
            self.log.info("malloc keeps freed memory mapped for the CPU forward's temporaries")
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        mc = self.model_config
        tp = config.world_size
        check_tp_size(mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size, tp)
        init_distributed(
            config.rank, tp, config.master_addr, config.master_port, self.device
        )
        spec = AttentionSpec(
            device=self.device,
            dtype=self.dtype,
            num_heads=mc.num_attention_heads // tp,
            num_kv_heads=kv_heads_per_rank(mc.num_key_value_heads, tp),
            head_dim=mc.head_dim,
            block_size=config.block_size,
        )
        self.backend, self.backend_reason = select_backend(config.attention_backend, spec)
        configure_pdl(config.pdl, self.device, self.log)
        self.log.info("attention backend {}: {}", self.backend.name, self.backend_reason)
        self.model = build_model(config, mc, self.backend, self.device, self.dtype)
        self.requests = RequestTable()
        self.kv_cache: list[KVCacheLayer] = []
        # decode CUDA graphs, captured at warmup (CUDA, a graph-safe backend, buckets set)
        self.graphs: DecodeGraphs | None = None
        self._last_pending: PendingStep | None = None  # the last launched step that samples
        # the device timer of the last launched step of any kind (the idle time between
        # steps, when shard.step_trace is on)
        self._last_timer: StepTimer | None = None
        self.grammars = GrammarCompiler(config.model_path, mc.vocab_size)

    @property
    def num_blocks(self) -> int:
        """KV blocks allocated (0 before warmup)."""
        return self.kv_cache[0].num_blocks if self.kv_cache else 0

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the configured size raised to what the backend needs."""
        return self.backend.kv_block_size(self.config.block_size)

    def info(self) -> ShardInfo:
        """Static facts for ``Info``."""
        return ShardInfo(
            model_id=self.config.served_model_id,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            rank=self.config.rank,
            world_size=self.config.world_size,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            attention_backend=self.backend.name,
            attention_backend_reason=self.backend_reason,
            max_position_embeddings=self.model_config.max_position_embeddings,
            vocab_size=self.model_config.vocab_size,
        )

    def bind_kv_cache(self, kv_cache: list[KVCacheLayer]) -> None:
        """Attach one cache layer to each attention layer (replacing any previous cache)."""
        layers = self.model.attention_layers()
        assert len(layers) == len(kv_cache), (
            f"{len(layers)} attention layers, {len(kv_cache)} cache layers"
        )
        for attn, cache in zip(layers, kv_cache, strict=True):
            attn.kv_cache = cache
        self.kv_cache = kv_cache

    def unbind_kv_cache(self) -> None:
        """Detach and release the KV cache (num_blocks becomes 0) and the CUDA graphs
        that read it."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_cache = []

    @torch.inference_mode()
    def warmup(
        self, max_batch_prefill_tokens: int, max_total_tokens: int, max_batch_size: int = 0,
        hold_total: bool = True,
    ) -> int:
        """Size and allocate the KV cache (see :mod:`shard.warmup`), run a worst-case
        prefill through it, capture the decode CUDA graphs (see :meth:`graph_buckets`)
        and drop every request held (also on failure, which leaves no cache). Each phase is
        announced (:class:`~shard.progress.PhaseProgress`).

        Args:
            max_batch_prefill_tokens: prefill token budget, tokens (> 0).
            max_total_tokens: longest request (prompt + generated), tokens (> 0).
            max_batch_size: most requests in a decode step (0 = unknown: no graphs).
            hold_total: the cache must hold one request of ``max_total_tokens`` (False:
                only the worst-case prefill; the router then lowers its default
                ``max_total_tokens`` to the capacity).

        Returns:
            the number of KV blocks allocated.

        Raises:
            KVCacheTooSmallError: the cache cannot hold the budgets (names the flag).
            ValueError: a budget is 0.
        """
        self.reset()
        self.unbind_kv_cache()  # a failed warmup leaves the shard without a cache
        buckets = self.graph_buckets(max_batch_size)
        if max_batch_prefill_tokens <= 0 or max_total_tokens <= 0:
            raise ValueError("max_batch_prefill_tokens and max_total_tokens must be > 0")
        per_block = bytes_per_block(
            self.model_config, self.block_size, self.dtype, self.config.world_size
        )
        chunks = dummy_chunks(max_batch_prefill_tokens, max_total_tokens, self.block_size)
        tune = self._tunes_gemms()
        with PhaseProgress("warm-up", WARMUP_PHASES + bool(buckets) + tune, self.log,
                           show_bar=self.config.rank == 0) as progress:
            if tune:
                progress.phase("timing cuBLASLt's algorithms for the products")
                gemm_tuning.clear()
                gemm_tuning.tune(linear_weights(self.model), max_batch_prefill_tokens, self.log,
                                 decode_rows=buckets,
                                 decode_weights=lm_head_weights(self.model),
                                 cache=self._tuning_cache(),
                                 decode_elsewhere=fused_decode_rows(self.model))
            if self.device.type == "cuda":
                progress.phase(
                    f"profiling a worst-case prefill of {max_batch_prefill_tokens} tokens"
                    + (" and the decode CUDA graphs" if buckets else "")
                )
                num_blocks = self._profile_kv_blocks(chunks, per_block, buckets, max_total_tokens)
                memory_flag = "--gpu-memory-fraction"
            else:
                progress.phase("sizing the KV cache (--kv-cache-bytes)")
                num_blocks = self.config.kv_cache_bytes // per_block
                memory_flag = "--kv-cache-bytes"
            check_kv_fits(num_blocks, chunks, self.block_size, per_block,
                          max_batch_prefill_tokens, max_total_tokens, memory_flag,
                          hold_total=hold_total)
            progress.phase(
                f"allocating the KV cache: {num_blocks} blocks of {self.block_size} tokens"
            )
            self.bind_kv_cache(self._allocate_kv_cache(num_blocks))
            progress.phase("running the worst-case prefill through the cache")
            self._run_dummy_prefill(chunks)
            if buckets:
                progress.phase(f"capturing decode CUDA graphs for batch sizes up to {buckets[-1]}")
                started = time.perf_counter()
                self.capture_graphs(buckets, max_total_tokens)
                self.log.info("captured decode CUDA graphs for batch sizes {} in {:.1f} s",
                              list(buckets), time.perf_counter() - started)
        self.log.info("warmup done: {} KV blocks of {} tokens", num_blocks, self.block_size)
        return num_blocks

    def _tunes_gemms(self) -> bool:
        """Whether warm-up tunes the products (``--gemm-tuning auto`` on CUDA with bfloat16
        or float16 weights)."""
        return (self.config.gemm_tuning == "auto" and self.device.type == "cuda"
                and self.dtype in (torch.bfloat16, torch.float16))

    def _tuning_cache(self) -> gemm_tuning.TuningCache | None:
        """The file of earlier warm-ups' tuning results for this GPU and these libraries,
        in ``--gemm-tuning-cache`` or under :func:`~shard.config.default_cache_dir` (None
        where cuBLASLt cannot be loaded: then nothing is tuned; or no cache folder
        resolves: then nothing is kept)."""
        try:
            identity = gemm_tuning.cache_identity(self.device)
        except (OSError, AttributeError):
            return None
        try:
            folder = (Path(self.config.gemm_tuning_cache).expanduser()
                      if self.config.gemm_tuning_cache
                      else default_cache_dir() / "gemm-tuning")
            path = gemm_tuning.cache_file(folder, identity)
        except RuntimeError as e:  # no cache folder configured and no home folder
            self.log.warning("GEMM tuning results not kept: {}", e)
            return None
        return gemm_tuning.TuningCache(path, identity, self.log)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCacheLayer]:
        return allocate_kv_cache(self.model_config, num_blocks, self.block_size, self.dtype,
                                 self.device, self.config.world_size,
                                 head_major=self.backend.kv_head_major(self.device))

    def _run_dummy_prefill(self, chunks: list[SeqChunk]) -> None:
        """The worst-case prefill and its sampling (both samplers), through the bound
        cache; then a few tokens of its first sequence again over the first half as a
        cached prefix, so that both prefill attention paths (prefix-free and over a
        cached prefix, which can be different kernels) are compiled and loaded before
        serving."""
        inputs, hidden = self.run_chunks(chunks, is_prefill=True)
        logits = self.model.compute_logits(hidden[inputs.last_token_indices])
        sample(logits, dummy_sampling_rows(len(chunks)))
        sample_greedy(logits)  # its kernel is compiled (or found unusable) here,
        if self.dtype != logits.dtype:  # and for a decode graph's logits (uncast)
            sample_greedy(logits.to(self.dtype))
        first = chunks[0]
        half = len(first.token_ids) // 2
        if half:
            tokens = first.token_ids[half:half + 16]
            self.run_chunks([SeqChunk(tokens, half, first.block_table)], is_prefill=True)
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
        self.bind_kv_cache(self._allocate_kv_cache(temp_blocks))
        self._run_dummy_prefill(chunks)
        peak = torch.cuda.max_memory_allocated(device)
        graph_bytes = 0
        if buckets:
            before = torch.cuda.memory_reserved(device)
            self.capture_graphs(buckets, max_total_tokens)
            graph_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        free, total = torch.cuda.mem_get_info(device)
        non_torch = total - free - torch.cuda.memory_reserved(device)
        self.unbind_kv_cache()
        torch.cuda.empty_cache()
        profile = MemoryProfile(total, peak, non_torch, temp_blocks * per_block, graph_bytes)
        fraction = self.config.gpu_memory_fraction
        self.log.info("{}", profile.describe(fraction))
        return profile.kv_budget(fraction) // per_block

    def graph_buckets(self, max_batch_size: int) -> list[int]:
        """Batch sizes whose decode runs as a CUDA graph: ``--cuda-graphs`` up to
        ``max_batch_size``; none off CUDA, with graphs off, or with a backend that
        cannot run inside a graph (the reason is logged)."""
        if self.device.type != "cuda" or max_batch_size <= 0:
            return []
        buckets = parse_buckets(self.config.cuda_graphs, max_batch_size)
        if buckets and not self.backend.cuda_graph_safe:
            self.log.warning(
                "decode runs eagerly: attention backend {} cannot run in a CUDA graph",
                self.backend.name,
            )
            return []
        return buckets

    def capture_graphs(self, buckets: Sequence[int], max_total_tokens: int) -> DecodeGraphs:
        """Capture the decode forward for ``buckets`` over the bound KV cache."""
        graphs = DecodeGraphs(
            self.model, self.backend, buckets, self.block_size, max_total_tokens, self.device
        )
        graphs.capture()
        self.graphs = graphs
        return graphs

    def run_chunks(
        self, chunks: Sequence[SeqChunk], is_prefill: bool
    ) -> tuple[ModelInputs, torch.Tensor]:
        """Forward ``chunks``; returns the inputs and hidden states [num_tokens, hidden]."""
        if not self.kv_cache:
            raise NotWarmedUpError("the KV cache is not allocated: call Warmup first")
        inputs = build_inputs(chunks, self.block_size, is_prefill, self.device)
        return inputs, self.forward(inputs)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """One eager forward step: the backend's per-step ``prepare``, then the model.
        Returns hidden states [num_tokens, hidden_size]."""
        self.backend.prepare(inputs.metadata)
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata)

    def prefill(self, step: PrefillStep, trace_step: int = -1) -> StepOutput:
        """One prefill step: :meth:`launch_prefill`, then :meth:`finish_step`."""
        launched = self.launch_prefill(step, trace_step)
        if isinstance(launched, StepOutput):
            return launched
        return self.finish_step(launched)

    @torch.inference_mode()
    def launch_prefill(self, step: PrefillStep, trace_step: int = -1) -> PendingStep | StepOutput:
        """Drop the finished requests, then compute the next chunk of each cached request
        and of each new one (new ones are held from now on), and sample the first token
        of each whose prompt this completes: those become decoding rows. The tokens are
        read by :meth:`finish_step`. ``trace_step``: the router's step number, for
        :mod:`shard.step_trace`.

        Launching does not wait for the device (unless a request asked for prompt
        logprobs): the new rows' first tokens stay on the device, where a decode step
        launched next reads them, so the next step is launched while this one computes.

        Returns:
            the pending step, or an empty :class:`StepOutput` when no prompt is
            completed (nothing is sampled).

        Raises:
            ValueError: a step inconsistent with the requests held (see
                :func:`~shard.step_checks.validate_prefill`).
            NotWarmedUpError: before Warmup.
        """
        if not self.kv_cache:
            raise NotWarmedUpError("the KV cache is not allocated: call Warmup first")
        table = self.requests
        validate_prefill(step, table, self.block_size, self.num_blocks,
                         self.model_config.vocab_size)
        table.finish(step.finished_request_ids)
        table.append_blocks({c.request_id: c.new_block_ids for c in step.cached_requests
                             if c.new_block_ids})
        t0 = time.perf_counter_ns()
        states: list[RequestState] = []
        chunks: list[SeqChunk] = []
        for c in step.cached_requests:
            state = table.get(c.request_id)
            end = len(state.token_ids) if c.num_tokens == 0 else state.seq_len + c.num_tokens
            chunks.append(SeqChunk(state.token_ids[state.seq_len:end], state.seq_len,
                                   state.block_table))
            state.seq_len = end
            states.append(state)
        for r in step.new_requests:
            state = _new_state(r, self._prefill_matcher(r))
            table.add(state)
            chunks.append(_prefill_chunk(r))
            states.append(state)
        wants_logprobs = [False] * len(step.cached_requests) + [
            r.prompt_logprobs for r in step.new_requests]
        inputs = build_inputs(chunks, self.block_size, True, self.device)
        # started after the host built the inputs: the device's wait for them counts as
        # idle time before the step
        timer = StepTimer(self.device)
        hidden = self.forward(inputs)
        previous_timer = self._last_timer
        rows = [i for i, s in enumerate(states) if s.seq_len == len(s.token_ids)]
        if not rows:
            timer.stop()
            self._last_timer = timer
            if step_trace.enabled:
                timer.synchronize()  # nothing is read back from a partial-only prefill
                timer.trace_gap_after(previous_timer, trace_step)
            return StepOutput((), time.perf_counter_ns() - t0)
        final = [states[i] for i in rows]
        last = inputs.last_token_indices
        if len(rows) < len(states):
            # NOTE: not last[rows]: indexing by a host list copies it from pageable
            # memory, which waits for the forward just queued
            last = last.index_select(0, to_device(rows, torch.int64, last.device))
        logits = self.model.compute_logits(hidden[last])
        mask = self._token_mask([s.grammar for s in final], logits.device)
        out = sample(logits, [_sampling_row(s) for s in final], mask)
        timer.stop()
        self._last_timer = timer  # stopped first: the next step reads its end event
        prompt_lps = tuple(
            self._prompt_logprobs(chunks[i], i, inputs, hidden) if wants_logprobs[i] else ()
            for i in rows
        )
        for state in final:
            state.num_generated += 1  # its first token (recorded when the step is read)
        # the next input of each new row, read on the device
        table.join(final, out.token_ids.clone(), self.device)
        return self._pending(final, out, timer, previous_timer, trace_step=trace_step,
                             prompt_logprobs=prompt_lps,
                             has_grammar=any(s.grammar is not None for s in final))

    def _prefill_matcher(self, r: NewRequest) -> GrammarMatcher | None:
        """The grammar state of a constrained request: fresh, or after a recompute
        rebuilt from the tokens it had generated (the last num_generated of input_ids)."""
        if not r.grammar:
            return None
        generated = r.input_ids[len(r.input_ids) - r.num_generated :]
        return self.grammars.matcher(r.grammar, r.request_id, generated)

    def _token_mask(
        self, matchers: Sequence[GrammarMatcher | None], device: torch.device
    ) -> TokenMask | None:
        """The allowed tokens of the constrained rows (None when no row is): the
        bitmasks are filled on the host, then copied and unpacked on ``device``."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = self.grammars.fill_bitmask([m for m in matchers if m is not None])
        allowed = unpack_bitmask(bitmask, self.model_config.vocab_size, device)
        index = to_device(rows, torch.int64, device)
        return TokenMask(index, allowed)

    def _prompt_logprobs(
        self, chunk: SeqChunk, index: int, inputs: ModelInputs, hidden: torch.Tensor
    ) -> tuple[float, ...]:
        """Logprobs of ``input_ids[max(cache_len, 1):]``, each from the logits of the
        token before it (all computed in this forward; see :func:`_prefill_chunk`)."""
        if len(chunk.token_ids) < 2:
            return ()
        first = int(inputs.metadata.cu_seqlens_q[index])
        rows = hidden[first : first + len(chunk.token_ids) - 1]
        logprobs = self.model.compute_logits(rows).log_softmax(dim=-1)
        targets = torch.tensor(chunk.token_ids[1:], dtype=torch.int64, device=logprobs.device)
        return tuple(logprobs.gather(1, targets[:, None]).squeeze(1).tolist())

    def decode(self, step: DecodeStep = NO_CHANGE) -> StepOutput:
        """One decode step: :meth:`launch_decode`, then :meth:`finish_step`."""
        pending = self.launch_decode(step)
        if isinstance(pending, StepOutput):
            return pending
        return self.finish_step(pending)

    @torch.inference_mode()
    def launch_decode(self, step: DecodeStep = NO_CHANGE) -> PendingStep | StepOutput:
        """Drop the finished requests, append the new blocks, then start one decode step
        over every decoding row; its results are read by :meth:`finish_step`.

        Launching does not wait for the device: the step's inputs come from device state
        (the previous step's sampled tokens included), so the next step can be launched
        while this one computes. Only a batch with penalties, which need the host's
        token history, first waits for the previous step's :meth:`finish_step`.

        Returns:
            the pending step, or an empty :class:`StepOutput` when no row is left.

        Raises:
            ValueError: a step inconsistent with the requests held (see
                :func:`~shard.step_checks.validate_decode`).
            NotWarmedUpError: before Warmup.
        """
        if not self.kv_cache:
            raise NotWarmedUpError("the KV cache is not allocated: call Warmup first")
        table = self.requests
        validate_decode(step, table, self.block_size, self.num_blocks)
        table.finish(step.finished_request_ids)
        table.append_blocks({c.request_id: c.new_block_ids for c in step.cached_requests
                             if c.new_block_ids})
        if table.rows is None:
            return StepOutput((), 0)
        timer = StepTimer(self.device)
        requests = list(table.decoding)
        max_seqlen_k = max(r.seq_len for r in requests) + 1
        logits = self._decode_logits(table.rows, max_seqlen_k)
        kind = table.kind
        mask = None
        if kind.has_grammar:
            # NOTE: the forward is already queued on the device; the grammar states need
            # the previous step's tokens, so the host waits for them here and fills the
            # masks while the device computes this step's logits.
            self._wait_previous_finish()
            mask = self._token_mask([r.grammar for r in requests], logits.device)
        if kind.plain_greedy:
            out = sample_greedy(logits, mask)
        else:
            if kind.has_penalty:
                self._wait_previous_finish()  # penalties read the host's token history
            out = sample(logits, [_sampling_row(r) for r in requests], mask)
        table.rows.advance(out.token_ids)
        for r in requests:
            r.advance()
        timer.stop()
        previous_timer, self._last_timer = self._last_timer, timer
        return self._pending(requests, out, timer, previous_timer,
                             has_grammar=kind.has_grammar)

    def _pending(
        self,
        requests: list[RequestState],
        out: SamplerOutput,
        timer: StepTimer,
        previous_timer: StepTimer | None,
        trace_step: int = -1,
        prompt_logprobs: tuple[tuple[float, ...], ...] = (),
        has_grammar: bool = False,
    ) -> PendingStep:
        """The launched step whose sampled ``out`` is on its way to the host, chained
        after the last launched one (finished first)."""
        pending = PendingStep(
            requests=requests,
            host=HostCopy([out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs]),
            timer=timer,
            previous=self._last_pending,
            trace_step=trace_step,
            previous_timer=previous_timer,
            prompt_logprobs=prompt_logprobs,
            has_grammar=has_grammar,
        )
        self._last_pending = pending
        return pending

    @torch.inference_mode()
    def finish_step(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched prefill or decode step's results and record its tokens on
        the host. Steps are finished in the order they were launched: each first waits
        for the one before it.

        Raises:
            RuntimeError: the step launched before it was not finished within 120 s.
        """
        try:
            if pending.previous is not None and not pending.previous.finished.wait(120.0):
                raise RuntimeError("the previous step was not finished within 120 s")
            pending.previous = None  # let the chain be freed
            tokens, logprobs, top_ids, top_lps = pending.host.wait()
            step_trace.mark("ready", pending.trace_step)
            pending.timer.trace_gap_after(pending.previous_timer, pending.trace_step)
            pending.previous_timer = None
            assert tokens is not None and logprobs is not None
            out = SamplerOutput(tokens, logprobs, top_ids, top_lps)
            requests = pending.requests
            generations = _generations(
                [r.request_id for r in requests],
                [r.top_n_tokens for r in requests],
                out,
                pending.prompt_logprobs or [()] * len(requests),
            )
            for r, g in zip(requests, generations, strict=True):
                r.record_token(g.token_id)
            failures = [(r.request_id, failure) for r in requests if r.grammar is not None
                        and (failure := r.grammar.failure) is not None
                        ] if pending.has_grammar else []
        finally:
            pending.finished.set()
        return StepOutput(tuple(generations), pending.timer.elapsed_ns(), tuple(failures))

    def _wait_previous_finish(self, timeout_s: float = 120.0) -> None:
        """Block until the last launched step is finished (its tokens recorded)."""
        pending = self._last_pending
        if pending is not None and not pending.finished.wait(timeout_s):
            raise RuntimeError(
                f"the previous step was not finished within {timeout_s:.0f} s"
            )

    def _decode_logits(self, rows: DecodeRows, max_seqlen_k: int) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step: a CUDA graph replay when a captured
        bucket holds the batch (the model's dtype), the eager forward otherwise
        (float32). Both samplers take either."""
        if not self.kv_cache:
            raise NotWarmedUpError("the KV cache is not allocated: call Warmup first")
        graphs = self.graphs
        if (
            graphs is not None
            and graphs.bucket_for(len(rows)) is not None
            and max_seqlen_k <= graphs.max_seqlen_k
        ):
            return graphs.run(rows)
        inputs = rows.model_inputs(self.block_size, max_seqlen_k)
        return self.model.compute_logits(self.forward(inputs))

    def reset(self) -> None:
        """Drop every request held (KV contents stay; the router owns blocks), and
        forget a launched step whose results were never read (its RPC was cancelled),
        so later steps do not wait for it: a new sequence of steps starts."""
        self.requests.clear()
        self._last_pending = None
        self._last_timer = None


def _prefill_chunk(r: NewRequest) -> SeqChunk:
    """Tokens to compute for a new request. NOTE: with prompt_logprobs and a cached
    prefix, the last cached token is recomputed (not rewritten) so the first new
    token's logprob is available."""
    start = r.cache_len
    if r.prompt_logprobs and r.cache_len > 0:
        start -= 1
    return SeqChunk(r.input_ids[start:r.end], start, r.block_ids, write_from=r.cache_len)


def _sampling_row(r: RequestState) -> SamplingRow:
    generated = TokenSuffix(r.token_ids, r.num_generated)
    return SamplingRow(r.sampling, r.num_generated, r.token_ids, generated, r.top_n_tokens)


def _new_state(r: NewRequest, grammar: GrammarMatcher | None) -> RequestState:
    """The state of a new request once this step's chunk is computed: ``end`` tokens
    cached, none generated in this step yet."""
    return RequestState(
        request_id=r.request_id,
        block_table=list(r.block_ids),
        token_ids=list(r.input_ids),
        seq_len=r.end,
        num_generated=r.num_generated,
        sampling=r.sampling,
        top_n_tokens=r.top_n_tokens,
        grammar=grammar,
    )


def _generations(
    request_ids: Sequence[int],
    top_ns: Sequence[int],
    out: SamplerOutput,
    prompt_lps: Sequence[tuple[float, ...]],
) -> list[Generation]:
    """Convert a :class:`SamplerOutput` to per-request :class:`Generation` records."""
    tokens = out.token_ids.tolist()
    logprobs = out.logprobs.tolist()
    top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    if top_ids is None or top_lps is None:  # no request asked for alternatives
        return list(map(Generation, request_ids, tokens, logprobs, repeat(()), prompt_lps))
    result = []
    for i, rid in enumerate(request_ids):
        top: tuple[TopToken, ...] = ()
        if top_ns[i] > 0:
            top = tuple(
                TopToken(t, lp)
                for t, lp in zip(top_ids[i][: top_ns[i]], top_lps[i][: top_ns[i]], strict=True)
            )
        result.append(Generation(rid, tokens[i], logprobs[i], top, prompt_lps[i]))
    return result
