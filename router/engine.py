"""The continuous-batching loop: prefill newcomers, decode the running batch, stream.

One asyncio task drives the shard group step by step. Between decode steps, waiting
requests are prefilled and join the running batch (their cached batch is concatenated
into the next ``Decode``); finished, cancelled and preempted requests leave it through
``FilterBatch``. Text is detokenized incrementally and checked against stop strings
here, so shards only ever see token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from loguru import logger

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.detokenizer import IncrementalDetokenizer
from router.metrics import Metrics
from router.request import (
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
    GenerationRequest,
    Sequence,
    TokenEvent,
    TopToken,
)
from router.scheduler import PrefillChunk, Scheduler
from router.shard_client import ShardClient, ShardError
from router.stop import StopSequenceChecker
from router.tokenizer import Tokenizer
from shard.pb import shard_pb2 as pb

T = TypeVar("T")

# Seconds /health reports unhealthy after a failed step (unless a step succeeds sooner).
HEALTH_RECOVERY_S = 10.0


class QueueFullError(RuntimeError):
    """More requests than ``--max-concurrent-requests`` are queued or running."""


class ShuttingDownError(QueueFullError):
    """The server is draining (SIGTERM, or its shard group is gone): no new requests."""


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop: StopSequenceChecker


class Engine:
    """Owns the scheduler and the shard client; serves request streams.

    Args:
        client: The shard group.
        tokenizer: The model's tokenizer (detokenization, EOS ids).
        config: Scheduler budgets.
        num_blocks: KV blocks usable on every rank (from Warmup).
        block_size: Tokens per KV block.
    """

    def __init__(
        self,
        client: ShardClient,
        tokenizer: Tokenizer,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size, config.prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self._failed_at: float | None = None
        self.draining = False
        self.metrics = Metrics(self._metrics_state)
        self._text: dict[int, _TextState] = {}
        self._batches: list[pb.CachedBatch] = []
        # token events of the last step, delivered once the next shard call is sent
        self._outbox: list[tuple[Sequence, TokenEvent]] = []
        self._ids = itertools.count()
        self._batch_ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- public API -------------------------------------------------------------

    def start(self) -> None:
        """Start the background loop (call from the serving event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        """Stop the loop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._deliver()

    def submit(self, request: GenerationRequest) -> Sequence:
        """Queue ``request``; its events arrive on ``Sequence.events``.

        Raises:
            QueueFullError: ``max_concurrent_requests`` are already queued or running.
            ShuttingDownError: the server is draining.
        """
        if self.draining:
            self.metrics.requests.labels("rejected").inc()
            raise ShuttingDownError("the server is shutting down")
        if self.scheduler.num_requests >= self.config.max_concurrent_requests:
            self.metrics.requests.labels("rejected").inc()
            raise QueueFullError(
                f"too many concurrent requests (max_concurrent_requests="
                f"{self.config.max_concurrent_requests})"
            )
        seq = Sequence(id=next(self._ids), request=request)
        self._text[seq.id] = _TextState(
            detokenizer=IncrementalDetokenizer(self.tokenizer, list(request.input_ids)),
            stop=StopSequenceChecker(list(request.stopping.stop_sequences)),
        )
        self.scheduler.add(seq)
        self._wake.set()
        return seq

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        """Submit ``request`` and yield its events until it finishes or fails.

        Closing the iterator early (client gone) cancels the request and frees its
        blocks within a step.
        """
        seq = self.submit(request)
        try:
            while True:
                event = await seq.events.get()
                yield event
                if isinstance(event, ErrorEvent) or event.finish is not None:
                    return
        finally:
            if seq.id in self._text:
                self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        """Abort ``seq``: a waiting one leaves the queue now, a running one leaves the
        batch (and frees its blocks) at the next step."""
        seq.cancelled = True
        if seq in self.scheduler.waiting:
            self._finish(seq, "cancelled")
        self._wake.set()

    @property
    def kv_blocks_free(self) -> int:
        """KV blocks with no owner."""
        return self.block_manager.num_free

    def _metrics_state(self) -> dict[str, float]:
        manager = self.block_manager
        return {
            "queue_size": len(self.scheduler.waiting),
            "running_batch_size": len(self.scheduler.running),
            "kv_blocks_total": manager.num_blocks,
            "kv_blocks_used": manager.num_blocks - manager.num_free,
            "prefix_cache_hit_tokens": manager.hit_tokens,
        }

    # ---- the loop ---------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.scheduler.num_requests:
                self._deliver()
                self._wake.clear()
                await self._wake.wait()
            try:
                if not await self._step():
                    # Requests wait but none can run yet: sleep until something changes.
                    self._deliver()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            except ShardError as error:
                logger.error("generation step failed: {}", error)  # clients get plain words
                self._fail_all(error.public_message)
                await self._clear_shards()
            except Exception:
                logger.exception("engine step failed")
                self._fail_all("internal error in the generation loop; see the server log")
                await self._clear_shards()

    async def _step(self) -> bool:
        """One prefill and/or decode step; False when nothing could run."""
        self._reap_cancelled()
        chunks = self.scheduler.schedule_prefill()
        if chunks:
            batch = pb.Batch(
                id=next(self._batch_ids), requests=[self._to_proto(chunk) for chunk in chunks]
            )
            self._on_admitted([chunk.seq for chunk in chunks])
            prefill = await self._send(self.client.prefill(batch))
            self.metrics.prefill_step.observe(prefill.timings.forward_ns / 1e9)
            for chunk in chunks:
                self.scheduler.on_prefilled(chunk)
            if prefill.batch.request_ids:
                self._batches.append(prefill.batch)
            self._on_generations(prefill.generations)
        worked = bool(chunks)
        self._reap_cancelled()  # cancelled while the prefill was in flight
        if self.scheduler.running:
            worked = True
            plan = self.scheduler.plan_decode()
            for seq in plan.preempted:
                logger.info("preempted request {} (out of KV blocks)", seq.id)
            await self._sync_batches()
            if self._batches:
                started = time.perf_counter()
                decode = await self._send(self.client.decode(self._batches, plan.block_appends))
                self.metrics.decode_step_wall.observe(time.perf_counter() - started)
                self.metrics.decode_step.observe(decode.timings.forward_ns / 1e9)
                self._batches = [decode.batch]
                self._on_generations(decode.generations)
        await self._sync_batches()
        self._failed_at = None
        return worked

    async def _send(self, call: Awaitable[T]) -> T:
        """Await a shard call, delivering the token events queued so far only once the
        call is on its way: the woken stream handlers then write their responses while
        the shards compute, instead of delaying the request (a grpc.aio call is sent by
        a task of its own, which would otherwise queue behind the handlers). Events are
        also delivered before the loop goes idle, on failure and on stop."""
        task = asyncio.ensure_future(call)
        try:
            await asyncio.sleep(0)  # the call's task runs and queues its send first
            self._deliver()
            return await task
        finally:
            task.cancel()  # no-op once done; stops the call if this step is cancelled

    def _deliver(self) -> None:
        """Put the queued token events on their sequences' streams, in order."""
        outbox, self._outbox = self._outbox, []
        for seq, event in outbox:
            seq.events.put_nowait(event)

    def _to_proto(self, chunk: PrefillChunk) -> pb.Request:
        seq = chunk.seq
        sampling = seq.request.sampling
        stopping = seq.request.stopping
        return pb.Request(
            id=seq.id,
            input_ids=seq.all_ids()[: chunk.end],
            cache_len=chunk.cache_len,
            block_ids=seq.block_ids[: self.block_manager.blocks_for_tokens(chunk.end)],
            partial=chunk.partial,
            sampling=pb.SamplingParameters(**sampling.__dict__),
            stopping=pb.StoppingParameters(
                max_new_tokens=stopping.max_new_tokens,
                stop_token_ids=stopping.stop_token_ids,
                ignore_eos=stopping.ignore_eos,
            ),
            top_n_tokens=seq.request.top_n_tokens,
            # Prompt logprobs are sent once, with the first token (not after a recompute).
            prompt_logprobs=seq.wants_prompt_logprobs,
            num_generated=len(seq.output_ids),
        )

    async def _sync_batches(self) -> None:
        """Drop from the shards' cached batches every request no longer running."""
        running = {seq.id for seq in self.scheduler.running}
        kept: list[pb.CachedBatch] = []
        for batch in self._batches:
            keep = [rid for rid in batch.request_ids if rid in running]
            if not keep:
                await self._send(self.client.clear_cache(batch.id))
            elif len(keep) < len(batch.request_ids):
                kept.append(await self._send(self.client.filter_batch(batch.id, keep)))
            else:
                kept.append(batch)
        self._batches = kept

    def _reap_cancelled(self) -> None:
        admitted = [*self.scheduler.running, *self.scheduler.prefilling]
        for seq in [s for s in admitted if s.cancelled]:
            self._finish(seq, "cancelled")

    def _on_admitted(self, sequences: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in sequences:
            if seq.admitted_time is None:  # not on a recompute after preemption
                seq.admitted_time = now
                self.metrics.queue_time.observe(now - seq.arrival_time)
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def _on_generations(self, generations: list[pb.Generation]) -> None:
        by_id = {seq.id: seq for seq in self.scheduler.running}
        for generation in generations:
            seq = by_id.get(generation.request_id)
            if seq is None or seq.cancelled:
                continue
            self._on_token(seq, generation)

    def _on_token(self, seq: Sequence, generation: pb.Generation) -> None:
        token_id = generation.token_id
        seq.output_ids.append(token_id)
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.time_to_first_token.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now
        self.metrics.generation_tokens.inc()
        state = self._text[seq.id]
        stopping = seq.request.stopping
        reason: FinishReason | None = None
        stop_text: str | None = None
        if token_id in self.tokenizer.eos_token_ids and not stopping.ignore_eos:
            reason = FinishReason.EOS_TOKEN
        elif token_id in stopping.stop_token_ids:
            reason = FinishReason.STOP_SEQUENCE
            stop_text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        text, match = state.stop.feed(state.detokenizer.add(token_id))
        if match is None and reason is None and (
            len(seq.output_ids) >= stopping.max_new_tokens
            or seq.num_tokens >= self.config.max_total_tokens
        ):
            reason = FinishReason.LENGTH
        if match is None and reason is not None:
            more, match = state.stop.feed(state.detokenizer.flush())
            text += more if match is not None else more + state.stop.flush()
        if match is not None:
            # TGI semantics: the text ends with the stop sequence (OpenAI strips it).
            reason, stop_text = FinishReason.STOP_SEQUENCE, match.stop
            text += match.stop
        finish = None
        if reason is not None:
            finish = Finish(reason, generated_tokens=len(seq.output_ids), stop_sequence=stop_text)
        event = TokenEvent(
            id=token_id,
            logprob=generation.logprob,
            text=text,
            special=self.tokenizer.is_special(token_id),
            top_tokens=tuple(TopToken(t.token_id, t.logprob) for t in generation.top_tokens),
            finish=finish,
            prompt_logprobs=tuple(generation.prompt_logprobs),
        )
        self._outbox.append((seq, event))
        if finish is not None:
            self._finish(seq, "success", finish)

    def _finish(self, seq: Sequence, outcome: str, finish: Finish | None = None) -> None:
        """Free ``seq``'s blocks, count it and write its one log line."""
        self.scheduler.finish(seq)
        self._text.pop(seq.id, None)
        now = time.monotonic()
        self.metrics.requests.labels(outcome).inc()
        if outcome == "success":
            self.metrics.e2e_latency.observe(now - seq.arrival_time)
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        logger.bind(request_id=seq.id).info(
            "request {} {}: prompt_tokens={} generated_tokens={} finish_reason={} "
            "queue_s={:.3f} ttft_s={} e2e_s={:.3f}",
            seq.id, outcome, len(seq.prompt_ids), len(seq.output_ids),
            finish.reason.value if finish else None,
            (seq.admitted_time or now) - seq.arrival_time,
            None if ttft is None else round(ttft, 3), now - seq.arrival_time,
        )

    def fail_all(self, message: str, include_waiting: bool = False) -> None:
        """End every running request (and queued ones with ``include_waiting``) with an
        :class:`ErrorEvent` (``message``) and mark the engine unhealthy (the launcher
        calls this when a rank dies; queued requests wait for the restarted group)."""
        self._fail_all(message, include_waiting)

    def replace_shards(self, client: ShardClient, num_blocks: int, block_size: int) -> None:
        """Serve from a restarted shard group: its KV cache is empty, so the block
        manager (and its prefix cache index) starts empty too. Call with the loop
        stopped and nothing running (after :meth:`fail_all`); queued requests stay."""
        assert not self.scheduler.running and not self.scheduler.prefilling, "requests running"
        self.client = client
        self.block_manager = BlockManager(num_blocks, block_size, self.config.prefix_caching)
        self.scheduler.block_manager = self.block_manager
        self._batches = []
        self._failed_at = None

    @property
    def healthy(self) -> bool:
        """False for ``HEALTH_RECOVERY_S`` after a failed step, unless a step succeeded
        since (so one transient failure cannot keep a readiness probe failing forever
        when no traffic arrives to prove recovery)."""
        return (
            self._failed_at is None
            or time.monotonic() - self._failed_at > HEALTH_RECOVERY_S
        )

    async def _clear_shards(self) -> None:
        """Best effort after a failed step: drop every batch the shards still hold."""
        try:
            await self.client.clear_cache()
        except ShardError as error:
            logger.warning("clearing the shards' batches failed: {}", error)

    def _fail_all(self, message: str, include_waiting: bool = False) -> None:
        logger.error("failing the running requests: {}", message)
        self._failed_at = time.monotonic()
        self._deliver()  # tokens computed before the failure come first
        for seq in self.scheduler.drain(include_waiting):
            seq.events.put_nowait(ErrorEvent(message=message))
            self._text.pop(seq.id, None)
            self.metrics.requests.labels("error").inc()
        self._batches = []
