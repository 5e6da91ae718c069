"""The continuous-batching loop: prefill newcomers, decode the running batch, stream.

One asyncio task drives the shard group step by step. Between decode steps, waiting
requests are prefilled and join the running batch (the shards decode them from the
next ``Decode`` on); finished, cancelled and preempted requests leave it with the next
step, by id. The loop's parts live beside it: the scheduler decides
(:mod:`router.scheduler`), :mod:`router.shard_steps` speaks the shard protocol,
:mod:`router.output` turns tokens into text and stream events, and
:mod:`router.metrics` observes. The API reads :meth:`Engine.status`; the supervisor
calls :meth:`Engine.drain`, :meth:`Engine.fail_all` and :meth:`Engine.replace_shards`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from loguru import logger

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.health import ShardHealth
from router.metrics import Metrics
from router.output import OutputProcessor
from router.request import (
    ErrorEvent,
    Event,
    EventStream,
    Finish,
    GenerationRequest,
    HeldAnswer,
    Refusal,
    Sequence,
    Status,
)
from router.scheduler import PrefillChunk, Scheduler
from router.shard_client import ShardClient, ShardError
from router.shard_steps import ShardSteps, StepResults
from router.tokenizer import Tokenizer
from shard import step_trace

# Seconds /health reports unhealthy after a failed step (unless a step succeeds sooner).
HEALTH_RECOVERY_S = 10.0
# After a failed step, how often the loop asks the shards whether they answer, seconds.
SHARD_RECHECK_S = 0.1


class QueueFullError(RuntimeError):
    """More requests than ``--max-concurrent-requests`` are queued or running."""

    refusal = Refusal.QUEUE_FULL


class ShuttingDownError(QueueFullError):
    """The server is draining (SIGTERM, or its shard group is gone): no new requests."""

    refusal = Refusal.SHUTTING_DOWN


def refusal_error(event: ErrorEvent) -> QueueFullError | None:
    """The exception ``submit`` raised for the refusal ``event`` carries (an engine in
    another process reports a refusal as its stream's only event), or None when the
    event is a failure after acceptance."""
    if event.refusal is Refusal.SHUTTING_DOWN:
        return ShuttingDownError(event.message)
    if event.refusal is Refusal.QUEUE_FULL:
        return QueueFullError(event.message)
    return None


class RequestHandle(Protocol):
    """A submitted request as its reader sees it: its id and its events."""

    @property
    def id(self) -> int: ...

    @property
    def events(self) -> EventStream: ...


class EngineApi(Protocol):
    """What the HTTP and public gRPC APIs use of the engine: :class:`Engine` in the same
    process, or :class:`router.engine_client.EngineClient` in an API process."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def config(self) -> SchedulerConfig: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def cancel(self, seq: Any) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Event, None]: ...

    def count_rejected(self) -> None: ...

    async def snapshot(self) -> EngineStatus: ...

    async def render_metrics(self) -> bytes: ...

    async def health_problem(self) -> str | None: ...


class EventSource:
    """``generate`` over a ``submit`` and a ``cancel``: shared by :class:`Engine` and the
    API process's proxy of it (:class:`router.engine_client.EngineClient`)."""

    def submit(self, request: GenerationRequest) -> RequestHandle:
        raise NotImplementedError

    def cancel(self, seq: Any) -> None:
        raise NotImplementedError

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        """Submit ``request`` and yield its events until it finishes or fails (a refusal
        is an :class:`ErrorEvent` whose ``refusal`` is set, when the engine is in
        another process; raised at once otherwise).

        Closing the iterator early (client gone) cancels the request and frees its
        blocks within a step.

        Raises:
            QueueFullError: the engine refused the request (see :meth:`Engine.submit`).
        """
        seq = self.submit(request)
        ended = False
        try:
            while True:
                event = await seq.events.get()
                while True:  # the events that came with it, without waiting again
                    if isinstance(event, HeldAnswer):  # a whole answer: its events
                        ended = True
                        for held in event.events():
                            yield held
                        return
                    ended = isinstance(event, ErrorEvent) or event.finish is not None
                    yield event
                    if ended:
                        return
                    if seq.events.empty():
                        break
                    event = seq.events.get_nowait()
        finally:
            if not ended:
                self.cancel(seq)


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
    """(sequence, epoch) pairs to match a call's results against (the scheduler counted
    their tokens in flight)."""
    return [(seq, seq.epoch) for seq in sequences]


@dataclass(frozen=True)
class EngineStatus:
    """What the API and the operator see of the engine at one moment.

    Attributes:
        draining: No new requests are admitted (SIGTERM, or the shard group is gone).
        healthy: False for a while after a failed step (see :attr:`Engine.healthy`).
        queue_size: Requests waiting for admission.
        running: Requests admitted (prefilling or decoding).
        block_size: Tokens per KV block.
        kv_blocks_total: KV blocks usable on every rank.
        kv_blocks_free: KV blocks with no owner.
        prefix_cache_hit_tokens: Prompt tokens served from the prefix cache so far.
    """

    draining: bool
    healthy: bool
    queue_size: int
    running: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hit_tokens: int

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free


class Engine(EventSource):
    """Owns the scheduler and the shard group's steps; serves request streams.

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
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, block_size, config.prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.shards = ShardSteps(client, block_size)
        self.output = OutputProcessor(tokenizer, self.scheduler)
        self.metrics = Metrics(self._metrics_state)
        self.shard_health = ShardHealth()  # the supervisor writes it, health probes read it
        self._failed_at: float | None = None
        self._draining = False
        # shard calls sent and not yet read, one list per loop iteration, oldest first
        self._inflight: collections.deque[list[_InFlight]] = collections.deque()
        self._decode_done = 0.0  # perf_counter() of the last decode result
        self._prefill_since_decode = False  # a prefill result came after it
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # called after replace_shards: the budgets and the KV capacity changed
        self.on_replaced: list[Callable[[], None]] = []

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
        self.output.deliver()

    def submit(self, request: GenerationRequest, events: EventStream | None = None) -> Sequence:
        """Queue ``request``; its events arrive on ``Sequence.events`` (``events`` when
        given: the reader of a request that came from an API process is a stream that
        forwards them there).

        Raises:
            QueueFullError: ``max_concurrent_requests`` are already queued or running.
            ShuttingDownError: the server is draining.
        """
        if self._draining:
            self.metrics.requests.labels("rejected").inc()
            raise ShuttingDownError("the server is shutting down")
        if self.scheduler.num_requests >= self.config.max_concurrent_requests and (
                self.scheduler.num_requests - len(self._cancelled_in_batch())
                >= self.config.max_concurrent_requests):
            self.metrics.requests.labels("rejected").inc()
            raise QueueFullError(
                f"too many concurrent requests (max_concurrent_requests="
                f"{self.config.max_concurrent_requests})"
            )
        seq = Sequence(id=next(self._ids), request=request)
        if events is not None:
            seq.events = events
        self.output.add(seq)
        self.scheduler.add(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Abort ``seq``: a waiting one leaves the queue now, a running one leaves the
        batch (and frees its blocks) at the next step."""
        seq.cancelled = True
        if seq in self.scheduler.waiting:
            self._finish(seq, "cancelled")
        self._wake.set()

    def drain(self) -> None:
        """Refuse new requests from now on (:class:`ShuttingDownError`); those already
        accepted go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        """Whether new requests are refused."""
        return self._draining

    @property
    def healthy(self) -> bool:
        """False for ``HEALTH_RECOVERY_S`` after a failed step, unless a step succeeded
        since (so one transient failure cannot keep a readiness probe failing forever
        when no traffic arrives to prove recovery)."""
        return (
            self._failed_at is None
            or time.monotonic() - self._failed_at > HEALTH_RECOVERY_S
        )

    def status(self) -> EngineStatus:
        """A snapshot for ``/info``, ``/health`` and the status log."""
        manager = self.block_manager
        return EngineStatus(
            draining=self._draining,
            healthy=self.healthy,
            queue_size=len(self.scheduler.waiting),
            running=len(self.scheduler.running) + len(self.scheduler.prefilling),
            block_size=manager.block_size,
            kv_blocks_total=manager.num_blocks,
            kv_blocks_free=manager.num_free,
            prefix_cache_hit_tokens=manager.hit_tokens,
        )

    async def snapshot(self) -> EngineStatus:
        """:meth:`status`, awaitable as the API process's proxy needs it."""
        return self.status()

    def count_rejected(self) -> None:
        """Count a request the API refused before it reached the engine."""
        self.metrics.requests.labels("rejected").inc()

    async def render_metrics(self) -> bytes:
        """The Prometheus text exposition of :attr:`metrics`."""
        return self.metrics.render()

    async def health_problem(self) -> str | None:
        """Why the server is not healthy, in plain words, or None when it is (``GET
        /health``, the gRPC health service and the API processes ask this).

        Answers at once from the known state, without a shard call: the shard group's
        health as the supervisor last saw it (:attr:`shard_health`: a rank not
        answering, the group restarting or down), then draining (SIGTERM), then a
        failed step within ``HEALTH_RECOVERY_S`` (:attr:`healthy`).
        """
        problem = self.shard_health.problem()
        if problem is not None:
            return problem
        if self._draining:
            return "shutting down"
        if not self.healthy:
            return "the last generation step failed"
        return None

    @property
    def kv_blocks_free(self) -> int:
        """KV blocks with no owner."""
        return self.block_manager.num_free

    async def check_shards(self) -> None:
        """Ask every rank for ``Health``.

        Raises:
            ShardError: a rank did not answer (its ``public_message`` is plain words).
        """
        await self.shards.client.health()

    @property
    def hung_rank(self) -> int | None:
        """A rank whose step ran past the step deadline, if any."""
        return self.shards.client.hung_rank

    async def close_shards(self) -> None:
        """Close the channels to the shard group (the group itself is the executor's)."""
        await self.shards.client.close()

    def fail_all(self, message: str, include_waiting: bool = False) -> None:
        """End every running request (and queued ones with ``include_waiting``) with an
        :class:`ErrorEvent` (``message``) and mark the engine unhealthy (the launcher
        calls this when a rank dies; queued requests wait for the restarted group)."""
        logger.error("failing the running requests: {}", message)
        self._failed_at = time.monotonic()
        self.output.deliver()  # tokens computed before the failure come first
        for seq in self.scheduler.drain(include_waiting):
            seq.events.put_nowait(ErrorEvent(message=message))
            self.output.remove(seq.id)
            self.metrics.requests.labels("error").inc()
        self.shards.restart()
        self._drop_inflight()

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler's budgets (the validator reads the same scheduler), derived
        from the last Warmup."""
        return self.scheduler.config

    def replace_shards(
        self, client: ShardClient, config: SchedulerConfig, num_blocks: int, block_size: int
    ) -> None:
        """Serve from a restarted shard group: its KV cache is empty, so the block
        manager (and its prefix cache index) starts empty too, sized by the new Warmup
        (``num_blocks``), and ``config`` holds the budgets derived from that Warmup.
        Call with the loop stopped and nothing running (after :meth:`fail_all`);
        queued requests stay."""
        assert not self.scheduler.running and not self.scheduler.prefilling, "requests running"
        self.shards.reset(client, block_size)
        hits = self.block_manager.hit_tokens  # a counter: it goes on across restarts
        self.block_manager = BlockManager(num_blocks, block_size, config.prefix_caching)
        self.block_manager.hit_tokens = hits
        self.scheduler.config = config
        self.scheduler.block_manager = self.block_manager
        self._drop_inflight()
        self._failed_at = None
        for listener in self.on_replaced:
            listener()

    def _metrics_state(self) -> dict[str, float]:
        status = self.status()
        return {
            "queue_size": status.queue_size,
            "running_batch_size": len(self.scheduler.running),
            "kv_blocks_total": status.kv_blocks_total,
            "kv_blocks_used": status.kv_blocks_used,
            "prefix_cache_hit_tokens": status.prefix_cache_hit_tokens,
        }

    # ---- the loop ---------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            # NOTE: a step still in flight is read even when no request is left (the
            # overlapped step after the last one finished): its shard time ends now, not
            # when the next request arrives
            if not self.scheduler.num_requests and not self._inflight:
                self.output.deliver()
                self._wake.clear()
                await self._wake.wait()
            try:
                if not await self._step():
                    # Requests wait but none can run yet: sleep until something changes.
                    self.output.deliver()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            except ShardError as error:
                logger.error("generation step failed: {}", error)  # clients get plain words
                self.fail_all(error.public_message)
                await self._until_shards_answer()
            except Exception:
                logger.exception("engine step failed")
                self.fail_all("internal error in the generation loop; see the server log")

    async def _step(self) -> bool:
        """Send this iteration's shard calls, then process the previous iteration's
        results while the shards compute (overlapped scheduling); False when nothing
        could run.

        The router's structural state (running set, blocks, the requests the shards
        hold) changes when a call is sent, since the shards run calls in the order sent;
        tokens are applied when their results are processed, ``steps_in_flight``
        iterations later. With one step in flight, a sequence that finished in step N
        was already sent in step N+1: it leaves the shards in step N+2 and its extra
        token is discarded (:meth:`_process`).
        """
        self._reap_cancelled()
        sent: list[_InFlight] = []
        plan = self.scheduler.schedule()
        if plan.chunks:
            sent.append(self._send_prefill(plan.chunks))
        for seq in plan.preempted:
            logger.info("preempted request {} (out of KV blocks)", seq.id)
            self.shards.release(seq.id)
        if plan.decoding:
            sent.append(self._send_decode(plan.decoding, plan.block_appends))
        if sent:
            self._inflight.append(sent)
        elif not self._inflight:
            return False
        # Read the oldest steps until config.steps_in_flight iterations stay in flight
        # (all of them when nothing new could be sent).
        keep = self.config.steps_in_flight if sent else 0
        while len(self._inflight) > keep:
            for call in self._inflight.popleft():
                await self._process(call)
        self._failed_at = None
        return True

    def _send_prefill(self, chunks: list[PrefillChunk]) -> _InFlight:
        self._on_admitted([chunk.seq for chunk in chunks])
        task, final = self.shards.prefill(chunks)
        by_id = {chunk.seq.id: chunk.seq for chunk in chunks}
        return _InFlight(task, "prefill", _sampled([by_id[rid] for rid in final]),
                         time.perf_counter())

    def _send_decode(
        self, decoding: list[Sequence], block_appends: dict[int, list[int]]
    ) -> _InFlight:
        """One Decode stepping ``decoding``, every one of them a row on the shards."""
        stepping = {seq.id: seq for seq in decoding}
        sent = self.shards.decode(stepping, block_appends)
        assert sent is not None, "running requests that are not rows on the shards"
        task, kept = sent
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
        self.output.deliver()
        try:
            response = await call.task
        finally:
            call.task.cancel()  # no-op once done; stops the call if this step is cancelled
        now = time.perf_counter()
        results: StepResults
        if call.kind == "prefill":
            results = ShardSteps.prefill_results(response)
            self.metrics.prefill_step.observe(results.forward_s)
            self._prefill_since_decode = True
        else:
            results = ShardSteps.decode_results(response, [seq.id for seq, _ in call.sampled])
            # With calls overlapped, a step's wall time runs from the later of its send
            # and the previous step's result (the time the shards could work on it). A
            # prefill between the two is the prefill's time, counted by prefill_step.
            if not self._prefill_since_decode:
                self.metrics.decode_step_wall.observe(
                    now - max(call.sent_at, self._decode_done))
            self.metrics.decode_step.observe(results.forward_s)
            self._decode_done = now
            self._prefill_since_decode = False
        assert len(results.token_ids) == len(call.sampled), (
            f"{call.kind} returned {len(results.token_ids)} tokens for "
            f"{len(call.sampled)} requests"
        )
        self._apply(call.sampled, results)
        if call.kind == "decode":
            step_trace.mark("applied", response.step)

    def _apply(self, sampled: list[tuple[Sequence, int]], results: StepResults) -> None:
        """Apply one call's tokens to the sequences they were sampled for."""
        arrived = time.monotonic()
        ttft = self.metrics.time_to_first_token
        itl = self.metrics.inter_token_latency
        on_token = self.output.on_token
        extras = results.extras
        logprobs = results.logprobs
        running = Status.RUNNING
        applied = 0
        if results.grammar_failures:  # these end now: the loop below skips them
            self._fail_grammars(sampled, results.grammar_failures)
        for index, ((seq, epoch), token_id) in enumerate(
            zip(sampled, results.token_ids, strict=True)
        ):
            if seq.epoch != epoch or seq.status is not running:
                continue
            seq.pending_tokens -= 1
            if seq.cancelled:
                continue
            seq.output_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = arrived
                ttft.observe(arrived - seq.arrival_time)
            elif seq.last_token_time is not None:
                itl.observe(arrived - seq.last_token_time)
            seq.last_token_time = arrived
            finish = on_token(seq, token_id, logprobs[index],
                              None if extras is None else extras[index])
            applied += 1
            if finish is not None:
                self._finish(seq, "success", finish)
        self.metrics.generation_tokens.inc(applied)

    def _fail_grammars(self, sampled: list[tuple[Sequence, int]], failures: dict[int, str]
                       ) -> None:
        """End each sequence of ``sampled`` still running in its epoch whose grammar
        failed on the shards (``failures``: id -> why) with an :class:`ErrorEvent`
        after the tokens it already has; its token of this step is void."""
        self.output.deliver()  # the tokens before the failure come first
        for seq, epoch in sampled:
            why = failures.get(seq.id)
            if (why is None or seq.epoch != epoch or seq.status is not Status.RUNNING
                    or seq.cancelled):
                continue
            logger.warning("request {}: its grammar failed on the shards: {}", seq.id, why)
            seq.events.put_nowait(ErrorEvent(
                message=f"grammar: failed after {len(seq.output_ids)} generated tokens "
                        f"({why}); no output can follow it: simplify the grammar",
                grammar=True,
            ))
            self._finish(seq, "error")

    def _cancelled_in_batch(self) -> list[Sequence]:
        """Cancelled requests still in the batch: they leave at the next step
        (:meth:`_reap_cancelled`), so they no longer count against
        ``max_concurrent_requests``."""
        return [seq for seq in (*self.scheduler.running, *self.scheduler.prefilling)
                if seq.cancelled]

    def _reap_cancelled(self) -> None:
        for seq in self._cancelled_in_batch():
            self._finish(seq, "cancelled")

    def _on_admitted(self, sequences: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in sequences:
            if seq.admitted_time is None:  # not on a recompute after preemption
                seq.admitted_time = now
                self.metrics.queue_time.observe(now - seq.arrival_time)
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def _finish(self, seq: Sequence, outcome: str, finish: Finish | None = None) -> None:
        """Free ``seq``'s blocks, count it and write its one log line."""
        self.scheduler.finish(seq)
        self.shards.release(seq.id)
        self.output.remove(seq.id)
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

    async def _until_shards_answer(self) -> None:
        """After a failed step, send nothing until every rank answers ``Health``: a dead
        or hung rank is the launcher's to find, and it stops this loop to restart the
        group (within ``LIVENESS_POLL_S`` or the step deadline), so requests that arrive
        meanwhile wait in the queue for the new group instead of failing on the old one.
        A rank that answers again (a transient failure) lets the loop go on."""
        while True:
            try:
                await self.check_shards()
                return
            except ShardError:
                await asyncio.sleep(SHARD_RECHECK_S)

    def _drop_inflight(self) -> None:
        """Forget the calls in flight (after a failure: their results no longer apply)."""
        for calls in self._inflight:
            for call in calls:
                call.task.cancel()
        self._inflight.clear()
