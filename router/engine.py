"""The continuous-batching loop: prefill newcomers, decode the running batch, stream.

One asyncio task drives the shard group step by step. Between decode steps, waiting
requests are prefilled and join the running batch (their cached batch is concatenated
into the next ``Decode``); finished, cancelled and preempted requests leave it through
``FilterBatch``. Text is detokenized incrementally and checked against stop strings
here, so shards only ever see token ids.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

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
    Status,
    TokenEvent,
    TopToken,
)
from router.scheduler import PrefillChunk, Scheduler
from router.shard_client import ShardClient, ShardError
from router.stop import StopSequenceChecker
from router.tokenizer import Tokenizer
from shard.pb import shard_pb2 as pb

# Seconds /health reports unhealthy after a failed step (unless a step succeeds sooner).
HEALTH_RECOVERY_S = 10.0


class QueueFullError(RuntimeError):
    """More requests than ``--max-concurrent-requests`` are queued or running."""


class ShuttingDownError(QueueFullError):
    """The server is draining (SIGTERM, or its shard group is gone): no new requests."""


@dataclass
class _InFlight:
    """A shard call sent and not yet processed.

    Attributes:
        task: the call.
        kind: "prefill" or "decode".
        sampled: the sequences it samples a token for, in response order, with the
            epoch each was in when sent.
        sent_at: ``time.perf_counter()`` when sent, seconds.
    """

    task: asyncio.Future[Any]
    kind: str
    sampled: list[tuple[Sequence, int]]
    sent_at: float


def _sampled(sequences: list[Sequence]) -> list[tuple[Sequence, int]]:
    """Count one token in flight for each of ``sequences``; (sequence, epoch) pairs to
    match the results against."""
    for seq in sequences:
        seq.pending_tokens += 1
    return [(seq, seq.epoch) for seq in sequences]


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
        # shard calls sent and not yet read, one list per loop iteration, oldest first
        self._inflight: collections.deque[list[_InFlight]] = collections.deque()
        self._decode_done = 0.0  # perf_counter() of the last decode result
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
        self._drop_inflight()
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
        """Send this iteration's shard calls, then process the previous iteration's
        results while the shards compute (overlapped scheduling); False when nothing
        could run.

        The router's structural state (running set, blocks, the shards' cached batches)
        changes when a call is sent, since the shards run calls in the order sent; tokens
        are applied when their results are processed, ``steps_in_flight`` iterations
        later. With one step in flight, a sequence that finished in step N was already
        sent in step N+1: it leaves the shards' batch in step N+2 and its extra token is
        discarded (:meth:`_process`).
        """
        self._reap_cancelled()
        sent: list[_InFlight] = []
        chunks = self.scheduler.schedule_prefill()
        if chunks:
            sent.append(self._send_prefill(chunks))
        decoding = [seq for seq in self.scheduler.running if self._needs_step(seq)]
        if decoding:
            plan = self.scheduler.plan_decode(decoding)
            for seq in plan.preempted:
                logger.info("preempted request {} (out of KV blocks)", seq.id)
            step = self._send_decode(decoding, plan.block_appends)
            if step is not None:
                sent.append(step)
        if sent:
            self._inflight.append(sent)
        elif not self._inflight:
            await self._sync_batches()
            return False
        # Read the oldest steps until config.steps_in_flight iterations stay in flight
        # (all of them when nothing new could be sent).
        keep = self.config.steps_in_flight if sent else 0
        while len(self._inflight) > keep:
            for call in self._inflight.popleft():
                await self._process(call)
        self._failed_at = None
        return True

    def _needs_step(self, seq: Sequence) -> bool:
        """Whether ``seq`` still needs a decode step: not when the tokens in flight
        already reach its ``max_new_tokens`` or ``max_total_tokens`` (its last token is
        being computed; another step would compute a token that is always discarded)."""
        generated = len(seq.output_ids) + seq.pending_tokens
        return (
            generated < seq.request.stopping.max_new_tokens
            and seq.num_tokens + seq.pending_tokens < self.config.max_total_tokens
        )

    def _send_prefill(self, chunks: list[PrefillChunk]) -> _InFlight:
        batch = pb.Batch(
            id=next(self._batch_ids), requests=[self._to_proto(chunk) for chunk in chunks]
        )
        self._on_admitted([chunk.seq for chunk in chunks])
        task = asyncio.ensure_future(self.client.prefill(batch))
        for chunk in chunks:
            self.scheduler.on_prefilled(chunk)
        final = [chunk.seq for chunk in chunks if not chunk.partial]
        if final:
            self._batches.append(pb.CachedBatch(id=batch.id, request_ids=[s.id for s in final]))
        return _InFlight(task, "prefill", _sampled(final), time.perf_counter())

    def _send_decode(
        self, decoding: list[Sequence], block_appends: dict[int, list[int]]
    ) -> _InFlight | None:
        """One Decode over every cached batch for ``decoding`` (those of them still
        running after the plan's preemptions); the other requests leave the batch in
        the same call. None when no request is left to step."""
        stepping = {seq.id: seq for seq in decoding if seq.status == Status.RUNNING}
        held = [rid for batch in self._batches for rid in batch.request_ids]
        kept = [rid for rid in held if rid in stepping]
        if not kept:
            return None
        removed = [rid for rid in held if rid not in stepping]
        task = asyncio.ensure_future(self.client.decode(self._batches, block_appends, removed))
        self._batches = [pb.CachedBatch(id=self._batches[0].id, request_ids=kept)]
        return _InFlight(
            task, "decode", _sampled([stepping[rid] for rid in kept]), time.perf_counter()
        )

    async def _process(self, call: _InFlight) -> None:
        """Await ``call`` and apply its tokens. The token events queued so far are
        delivered first, once the calls just created have sent their requests: the
        stream handlers then write their responses while the shards compute.

        A token is applied only to a sequence still running in the epoch it was sent
        in (not finished, cancelled or preempted since)."""
        await asyncio.sleep(0)  # the new calls' tasks run and queue their sends first
        self._deliver()
        try:
            response = await call.task
        finally:
            call.task.cancel()  # no-op once done; stops the call if this step is cancelled
        now = time.perf_counter()
        rows: list[tuple[int, float, pb.Generation | None]]
        if call.kind == "prefill":
            self.metrics.prefill_step.observe(response.timings.forward_ns / 1e9)
            rows = [(g.token_id, g.logprob, g) for g in response.generations]
        else:
            # with calls overlapped, a step's wall time runs from the later of its send
            # and the previous step's result (the time the shards could work on it)
            self.metrics.decode_step_wall.observe(now - max(call.sent_at, self._decode_done))
            self.metrics.decode_step.observe(response.timings.forward_ns / 1e9)
            self._decode_done = now
            extras = {g.request_id: g for g in response.generations}
            rows = [
                (token, logprob, extras.get(rid))
                for rid, token, logprob in zip(
                    response.batch.request_ids, response.token_ids, response.logprobs,
                    strict=True,
                )
            ]
        assert len(rows) == len(call.sampled), (
            f"{call.kind} returned {len(rows)} tokens for {len(call.sampled)} requests"
        )
        arrived = time.monotonic()
        applied = 0
        for (seq, epoch), (token, logprob, extra) in zip(call.sampled, rows, strict=True):
            if seq.epoch != epoch or seq.status != Status.RUNNING:
                continue
            seq.pending_tokens -= 1
            if not seq.cancelled:
                self._on_token(seq, token, logprob, extra, arrived)
                applied += 1
        self.metrics.generation_tokens.inc(applied)

    def _deliver(self) -> None:
        """Put the queued token events on their sequences' streams, in order."""
        outbox, self._outbox = self._outbox, []
        for seq, event in outbox:
            if seq.cancelled:  # nothing reaches a stream after its cancellation
                continue
            if seq.request.stream:
                seq.events.put_nowait(event)
                continue
            seq.held_events.append(event)
            if event.finish is not None:
                for held in seq.held_events:
                    seq.events.put_nowait(held)
                seq.held_events.clear()

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
            grammar=seq.request.grammar,
        )

    async def _sync_batches(self) -> None:
        """Drop from the shards' cached batches every request no longer running."""
        running = {seq.id for seq in self.scheduler.running}
        kept: list[pb.CachedBatch] = []
        for batch in self._batches:
            keep = [rid for rid in batch.request_ids if rid in running]
            if not keep:
                await self.client.clear_cache(batch.id)
            elif len(keep) < len(batch.request_ids):
                kept.append(await self.client.filter_batch(batch.id, keep))
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

    def _on_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float,
        extra: pb.Generation | None,
        now: float,
    ) -> None:
        """Apply one generated token: stop checks, text, the event for the stream.
        ``extra`` carries top tokens and prompt logprobs when the request asked; ``now``
        is ``time.monotonic()`` when the step's result arrived."""
        seq.output_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.time_to_first_token.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now
        state = self._text[seq.id]
        stopping = seq.request.stopping
        reason: FinishReason | None = None
        stop_text: str | None = None
        if token_id in self.tokenizer.eos_token_ids and (
            not stopping.ignore_eos or seq.request.grammar
        ):
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
            logprob=logprob,
            text=text,
            special=self.tokenizer.is_special(token_id),
            top_tokens=()
            if extra is None
            else tuple(TopToken(t.token_id, t.logprob) for t in extra.top_tokens),
            finish=finish,
            prompt_logprobs=() if extra is None else tuple(extra.prompt_logprobs),
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
        self._drop_inflight()
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
        self._drop_inflight()

    def _drop_inflight(self) -> None:
        """Forget the calls in flight (after a failure: their results no longer apply)."""
        for calls in self._inflight:
            for call in calls:
                call.task.cancel()
        self._inflight.clear()
