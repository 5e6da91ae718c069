"""The model runner: turns Prefill/Decode steps into tensors, runs the model,
samples, and updates the requests the shard holds (:class:`~shard.requests.RequestTable`).
Synchronous; the servicer calls it from a worker thread under a lock.

Entry points: :meth:`ModelRunner.info`, :meth:`~ModelRunner.warmup`,
:meth:`~ModelRunner.prefill`, :meth:`~ModelRunner.decode`, :meth:`~ModelRunner.reset`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from loguru import logger

from shard import step_trace
from shard.attention import AttentionSpec, select_backend
from shard.config import ShardConfig, dtype_name
from shard.cuda_graphs import DecodeGraphs
from shard.decode_state import DecodeRows
from shard.distributed import init_distributed
from shard.errors import NotWarmedUpError
from shard.grammar import GrammarCompiler, GrammarMatcher
from shard.host_copy import to_device
from shard.host_memory import retain_freed_memory
from shard.inputs import ModelInputs, SeqChunk, build_inputs, concat_inputs
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer
from shard.layers.tp_layout import check_tp_size, kv_heads_per_rank
from shard.model_loader import build_model
from shard.models.config import ModelConfig
from shard.pending_step import PendingStep, StepChain, StepTimer
from shard.prompt_logprobs import prefill_chunk, prompt_logprobs
from shard.quantization.config import resolve_kv_cache_dtype
from shard.records import DecodeStep, NewRequest, PrefillStep, ShardInfo, StepOutput
from shard.requests import RequestState, RequestTable
from shard.speculative.draft import DraftModel, DraftProposer
from shard.speculative.ngram import NgramProposer
from shard.speculative.step import SpeculativeDecoder
from shard.step_checks import validate_decode, validate_prefill
from shard.step_sampler import StepSampler
from shard.warmup import Warmup

# A Decode that changes nothing: every row steps as it is.
NO_CHANGE = DecodeStep()


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
        init_distributed(config.rank, tp, config.master_addr, config.master_port, self.device)
        spec = AttentionSpec(device=self.device, dtype=self.dtype,
                             num_heads=mc.num_attention_heads // tp,
                             num_kv_heads=kv_heads_per_rank(mc.num_key_value_heads, tp),
                             head_dim=mc.head_dim, block_size=config.block_size,
                             kv_cache_dtype=resolve_kv_cache_dtype(config, self.dtype, self.device))
        # our kernels, PDL (--pdl) and the GEMM table (tuned at warm-up)
        self.kernels = KernelChoices.load(self.device, config.pdl, self.log)
        self.backend, self.backend_reason = select_backend(config.attention_backend, spec,
                                                           self.kernels)
        self.log.info("attention backend {}: {}", self.backend.name, self.backend_reason)
        self.model = build_model(config, mc, self.backend, self.device, self.dtype,
                                 self.kernels)
        self.requests = RequestTable()
        self.kv_cache: list[KVCacheLayer] = []
        # decode CUDA graphs, captured at warmup (CUDA, a graph-safe backend, buckets set)
        self.graphs: DecodeGraphs | None = None
        self.trace = step_trace.from_config(config)  # a NullTrace unless --step-trace-dir
        self.chain = StepChain(self.trace)  # the steps launched and not read yet
        self.grammars = GrammarCompiler(config.model_path, mc.vocab_size)
        self.sampler = StepSampler(self.grammars, self.kernels, self.chain)
        # speculative Decodes (--speculative-method), or None: they are refused; the
        # draft model of --speculative-method draft (its cache sized at warm-up)
        self.draft: DraftModel | None = None
        self.speculator = speculative_decoder(self)

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

    def warmup(
        self, max_batch_prefill_tokens: int, max_total_tokens: int, max_batch_size: int = 0,
        hold_total: bool = True,
    ) -> int:
        """Size and allocate the KV cache, run a worst-case prefill through it, capture
        the decode CUDA graphs (see :func:`~shard.cuda_graphs.graph_buckets`) and drop
        every request held (also on failure, which leaves no cache): a
        :class:`~shard.warmup.Warmup`. Each phase is announced
        (:class:`~shard.progress.PhaseProgress`).

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
        return Warmup(self).run(max_batch_prefill_tokens, max_total_tokens, max_batch_size,
                                hold_total)

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
        of each whose prompt this completes: those become decoding rows. With
        ``step.decode`` (a mixed step) every decoding row held before the step also
        computes its next token in the same forward, as :meth:`launch_decode` would.
        The tokens are read by :meth:`finish_step`. ``trace_step``: the router's step
        number, for :mod:`shard.step_trace`.

        Launching does not wait for the device (unless a request asked for prompt
        logprobs, or a row needs the previous step's tokens on the host: a grammar or
        a penalty): the new rows' first tokens stay on the device, where a decode step
        launched next reads them, so the next step is launched while this one computes.

        Returns:
            the pending step, or an empty :class:`StepOutput` when nothing is sampled
            (no prompt completed, no row stepped).

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
        table.append_blocks({c.request_id: c.new_block_ids
                             for c in (*step.cached_requests, *step.row_appends)
                             if c.new_block_ids})
        t0 = time.perf_counter_ns()
        states, chunks = table.next_chunks(step.cached_requests)
        for r in step.new_requests:
            state = _new_state(r, self.grammars.prefill_matcher(r))
            table.add(state)
            chunks.append(prefill_chunk(r))
            states.append(state)
        wants_logprobs = [False] * len(step.cached_requests) + [
            r.prompt_logprobs for r in step.new_requests]
        inputs = build_inputs(chunks, self.block_size, True, self.device)
        rows = list(table.decoding) if step.decode and table.rows is not None else []
        if rows:  # the rows' one token each, after the chunks
            assert table.rows is not None
            max_seqlen_k = max(r.seq_len for r in rows) + 1
            inputs = concat_inputs(inputs, table.rows.model_inputs(self.block_size,
                                                                   max_seqlen_k))
        # started after the host built the inputs: the device's wait for them counts as
        # idle time before the step
        timer = StepTimer(self.device)
        hidden = self.forward(inputs)
        previous_timer = self.chain.last_timer
        completed = [i for i, s in enumerate(states) if s.seq_len == len(s.token_ids)]
        if not completed and not rows:
            self.chain.unsampled(timer, previous_timer, trace_step)
            return StepOutput((), time.perf_counter_ns() - t0)
        final = [states[i] for i in completed]
        # the rows' logits first (row order), then the completed prompts'
        picked = [len(chunks) + j for j in range(len(rows))] + completed
        last = inputs.last_token_indices
        if picked != list(range(len(chunks) + len(rows))):
            # NOTE: not last[picked]: indexing by a host list copies it from pageable
            # memory, which waits for the forward just queued
            last = last.index_select(0, to_device(picked, torch.int64, last.device))
        logits = self.model.compute_logits(hidden[last])
        out = self.sampler.sample(logits, [*rows, *final], table.kind if rows else None)
        if rows:
            assert table.rows is not None
            table.rows.advance(out.token_ids[: len(rows)])
            for row in rows:
                row.advance()
        timer.stop()
        self.chain.last_timer = timer  # stopped first: the next step reads its end event
        prompt_lps = tuple(
            prompt_logprobs(self.model, chunks[i], i, inputs, hidden) if wants_logprobs[i] else ()
            for i in completed
        )
        for state in final:
            state.num_generated += 1  # its first token (recorded when the step is read)
        if final:  # the next input of each new row, read on the device
            table.join(final, out.token_ids[len(rows):].clone(), self.device)
        return self.chain.launched(
            [*rows, *final], out, timer, previous_timer, trace_step=trace_step,
            prompt_logprobs=((),) * len(rows) + prompt_lps if any(prompt_lps) else (),
            has_grammar=any(s.grammar is not None for s in (*rows, *final)),
            num_rows=len(rows))

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

        A speculative step (``step.num_speculative_tokens`` > 0) runs to its end here
        (:class:`~shard.speculative.step.SpeculativeDecoder`), unless no row has a
        guess: then it is a plain decode step.

        Returns:
            the pending step, or a :class:`StepOutput`: a speculative step's, or an
            empty one when no row is left.

        Raises:
            ValueError: a step inconsistent with the requests held (see
                :func:`~shard.step_checks.validate_decode`), or a speculative step on a
                shard started without a proposer.
            NotWarmedUpError: before Warmup.
        """
        if not self.kv_cache:
            raise NotWarmedUpError("the KV cache is not allocated: call Warmup first")
        if step.num_speculative_tokens and self.speculator is None:
            raise ValueError("num_speculative_tokens: speculative decoding is off on this "
                             "shard (start it with --speculative-method)")
        table = self.requests
        validate_decode(step, table, self.block_size, self.num_blocks)
        table.finish(step.finished_request_ids)
        table.append_blocks({c.request_id: c.new_block_ids for c in step.cached_requests
                             if c.new_block_ids})
        if table.rows is None:
            return StepOutput((), 0)
        if step.num_speculative_tokens:
            assert self.speculator is not None
            verified = self.speculator.run(step)
            if verified is not None:
                return verified
        timer = StepTimer(self.device)
        requests = list(table.decoding)
        max_seqlen_k = max(r.seq_len for r in requests) + 1
        logits = self.decode_logits(table.rows, max_seqlen_k)
        out = self.sampler.sample(logits, requests, table.kind)
        table.rows.advance(out.token_ids)
        for r in requests:
            r.advance()
        timer.stop()
        previous_timer, self.chain.last_timer = self.chain.last_timer, timer
        return self.chain.launched(requests, out, timer, previous_timer,
                                   has_grammar=table.kind.has_grammar)

    @torch.inference_mode()
    def finish_step(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched prefill or decode step's results and record its tokens on
        the host. Steps are finished in the order they were launched: each first waits
        for the one before it.

        Raises:
            RuntimeError: the step launched before it was not finished within 120 s.
        """
        return self.chain.finish(pending)

    def decode_logits(self, rows: DecodeRows, max_seqlen_k: int) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step: a CUDA graph replay when a captured
        bucket holds the batch (the model's dtype), the eager forward otherwise
        (float32). Both samplers take either."""
        if self.graphs is not None and self.graphs.holds(len(rows), max_seqlen_k):
            return self.graphs.run(rows)
        inputs = rows.model_inputs(self.block_size, max_seqlen_k)
        return self.model.compute_logits(self.forward(inputs))

    def reset(self) -> None:
        """Drop every request held (KV contents stay; the router owns blocks), and
        forget a launched step whose results were never read (its RPC was cancelled),
        so later steps do not wait for it: a new sequence of steps starts."""
        self.requests.clear()
        self.chain.reset()


def speculative_decoder(runner: ModelRunner) -> SpeculativeDecoder | None:
    """The runner's verifier with the proposer its configuration names, or None."""
    config = runner.config
    if config.speculative_method == "ngram":
        return SpeculativeDecoder(runner, NgramProposer(config.ngram_min, config.ngram_max))
    if config.speculative_method == "draft":
        runner.draft = DraftModel(runner)
        return SpeculativeDecoder(runner, DraftProposer(runner.draft))
    return None


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
