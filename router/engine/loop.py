"""The continuous-batching loop: prefill newcomers, decode the running batch, stream.

One asyncio task drives the shard group step by step. Each iteration the scheduler
says what to run (:meth:`router.scheduler.Scheduler.schedule`): prompt chunks to
prefill, then the running requests to decode, which the shards run in that order
(:mod:`router.shard_steps` speaks the step contract); finished, cancelled and preempted
requests leave the shards with the next step, by id. The iteration then reads the
results of the one before it while the shards compute (:mod:`router.engine.inflight`), and
:mod:`router.engine.lifecycle` applies their tokens. The API reads :meth:`Engine.status`
(:mod:`router.engine.api` has what it sees); the supervisor calls
:meth:`Engine.drain`, :meth:`Engine.fail_all` and :meth:`Engine.replace_shards`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable

from loguru import logger

from router import health
from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.engine.api import (
    EngineStatus,
    EventSource,
    QueueFullError,
    ShuttingDownError,
)
from router.engine.inflight import InFlight, InFlightSteps
from router.engine.lifecycle import Lifecycle
from router.health import ShardHealth
from router.metrics import Metrics
from router.output import OutputProcessor
from router.request import ErrorEvent, EventStream, GenerationRequest, Sequence
from router.scheduler import Scheduler
from router.shard_client import ShardClient, ShardError
from router.shard_steps import ShardSteps
from router.step_trace import NullTrace, Trace
from router.tokenizer import Tokenizer

# Seconds /health reports unhealthy after a failed step (unless a step succeeds sooner).
HEALTH_RECOVERY_S = 10.0


class Engine(EventSource):
    """Owns the scheduler and the shard group's steps; serves request streams.

    Args:
        client: The shard group.
        tokenizer: The model's tokenizer (detokenization, EOS ids).
        config: Scheduler budgets.
        num_blocks: KV blocks usable on every rank (from Warmup).
        block_size: Tokens per KV block.
        trace: Where each step's ``applied`` goes (:mod:`router.step_trace`); the shard
            clients of this engine, restarted ones too, take the same.
    """

    def __init__(self, client: ShardClient, tokenizer: Tokenizer, config: SchedulerConfig,
                 num_blocks: int, block_size: int, trace: Trace | None = None) -> None:
        self.trace = trace if trace is not None else NullTrace()
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, block_size, config.prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.shards = ShardSteps(client)
        self.output = OutputProcessor(tokenizer, self.scheduler)
        self.metrics = Metrics(lambda: _metrics_state(self.status(), len(self.scheduler.running)))
        self.lifecycle = Lifecycle(self.scheduler, self.shards, self.output, self.metrics)
        self.inflight = InFlightSteps(self.metrics, self.trace)
        self.shard_health = ShardHealth()  # the supervisor writes it, health probes read it
        self._failed_at: float | None = None
        self._draining = False
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # called after replace_shards: the budgets and the KV capacity changed
        self.on_replaced: list[Callable[[], None]] = []

    # ---- what the API and the supervisor call ------------------------------------

    def start(self) -> None:
        """Start the background loop (call from the serving event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        """Stop the loop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.inflight.drop()
        self.output.deliver()

    def submit(self, request: GenerationRequest, events: EventStream | None = None) -> Sequence:
        """Queue ``request``; its events arrive on ``Sequence.events`` (``events`` when
        given: the reader of a request that came from an API process is a stream that
        forwards them there).

        Raises:
            QueueFullError: ``max_concurrent_requests`` are already queued or running
                (cancelled ones still in the batch do not count).
            ShuttingDownError: the server is draining.
        """
        limit = self.config.max_concurrent_requests
        if self._draining:
            self.count_rejected()
            raise ShuttingDownError("the server is shutting down")
        if (self.scheduler.num_requests >= limit
                and self.scheduler.num_requests - len(self.scheduler.cancelled()) >= limit):
            self.count_rejected()
            raise QueueFullError(f"too many concurrent requests (max_concurrent_requests={limit})")
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
            self.lifecycle.finish(seq, "cancelled")
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
    def config(self) -> SchedulerConfig:
        """The scheduler's budgets (the validator reads the same scheduler), derived
        from the last Warmup."""
        return self.scheduler.config

    @property
    def healthy(self) -> bool:
        """False for ``HEALTH_RECOVERY_S`` after a failed step, unless a step succeeded
        since (one transient failure cannot keep a readiness probe failing when no
        traffic arrives to prove recovery)."""
        return self._failed_at is None or time.monotonic() - self._failed_at > HEALTH_RECOVERY_S

    def status(self) -> EngineStatus:
        """A snapshot for ``/info``, ``/health`` and the status log."""
        manager, scheduler = self.block_manager, self.scheduler
        return EngineStatus(
            draining=self._draining, healthy=self.healthy, queue_size=len(scheduler.waiting),
            running=len(scheduler.running) + len(scheduler.prefilling),
            block_size=manager.block_size, kv_blocks_total=manager.num_blocks,
            kv_blocks_free=manager.num_free, prefix_cache_hit_tokens=manager.hit_tokens,
            speculative_proposed=self.lifecycle.guesses_proposed,
            speculative_accepted=self.lifecycle.guesses_accepted,
        )

    async def snapshot(self) -> EngineStatus:
        """:meth:`status`, awaitable as the API process's proxy needs it."""
        return self.status()

    def count_rejected(self) -> None:
        """Count a request refused before it reached the scheduler."""
        self.metrics.requests.labels("rejected").inc()

    async def render_metrics(self) -> bytes:
        """The Prometheus text exposition of :attr:`metrics`."""
        return self.metrics.render()

    async def health_problem(self) -> str | None:
        """Why the server is not healthy, in plain words, or None (see
        :func:`router.health.describe`); answers at once, without a shard call."""
        return health.describe(self.shard_health, self._draining, self.healthy)

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
        # NOTE: blocks enter the prefix index when their step is sent; the failed step
        # and those abandoned after it may never have computed theirs, and which did is
        # unknown: the index starts empty (every block is free once the batch is drained)
        self._new_block_manager(self.block_manager.num_blocks, self.block_manager.block_size)
        self.shards.restart()
        self.inflight.drop()

    def replace_shards(
        self, client: ShardClient, config: SchedulerConfig, num_blocks: int, block_size: int
    ) -> None:
        """Serve from a restarted shard group: its KV cache is empty, so the block
        manager (and its prefix cache index) starts empty too, sized by the new Warmup
        (``num_blocks``), and ``config`` holds the budgets derived from that Warmup.
        Call with the loop stopped and nothing running (after :meth:`fail_all`);
        queued requests stay."""
        assert not self.scheduler.running and not self.scheduler.prefilling, "requests running"
        self.shards.reset(client)
        self.scheduler.config = config
        self._new_block_manager(num_blocks, block_size)
        self.inflight.drop()
        self._failed_at = None
        for listener in self.on_replaced:
            listener()

    def _new_block_manager(self, num_blocks: int, block_size: int) -> None:
        """Every block free and the prefix index empty (no request may hold blocks)."""
        hits = self.block_manager.hit_tokens  # a counter: it goes on across restarts
        self.block_manager = BlockManager(num_blocks, block_size, self.config.prefix_caching)
        self.block_manager.hit_tokens = hits
        self.scheduler.block_manager = self.block_manager

    # ---- the loop -------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            # NOTE: a step still in flight is read even when no request is left (the
            # overlapped step after the last one finished): its shard time ends now, not
            # when the next request arrives
            if not self.scheduler.num_requests and not self.inflight:
                await self._idle(None)
            try:
                if not await self._step():
                    await self._idle(0.05)  # requests wait but none can run yet
            except ShardError as error:
                logger.error("generation step failed: {}", error)  # clients get plain words
                self.fail_all(error.public_message)
                await health.until_shards_answer(self.shards.client)
            except Exception:
                logger.exception("engine step failed")
                self.fail_all("internal error in the generation loop; see the server log")

    async def _idle(self, timeout_s: float | None) -> None:
        """Deliver what is queued, then wait for a submit or a cancel (at most
        ``timeout_s`` seconds when given)."""
        self.output.deliver()
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout_s)

    def _release_preempted(self, preempted: list[Sequence]) -> None:
        for seq in preempted:
            logger.info("preempted request {} (out of KV blocks)", seq.id)
            self.shards.release(seq.id)

    async def _step(self) -> bool:
        """Send this iteration's shard calls, then process the previous iteration's
        results while the shards compute (overlapped scheduling); False when nothing
        could run.

        The router's structural state (running set, blocks, the requests the shards
        hold) changes when a call is sent, since the shards run calls in the order sent;
        tokens are applied when their results are processed, ``steps_in_flight``
        iterations later. With one step in flight, a sequence that finished in step N
        was already sent in step N+1: it leaves the shards in step N+2 and its extra
        token is discarded (see :meth:`Lifecycle.apply`).
        """
        for seq in self.scheduler.cancelled():
            self.lifecycle.finish(seq, "cancelled")
        plan = self.scheduler.schedule()
        sent: list[InFlight] = []
        stepping = {seq.id: seq for seq in plan.decoding}
        mixed = bool(plan.chunks) and plan.mixed and bool(stepping)
        # NOTE: with mixed steps the rows were served before the chunks were chosen, and
        # a row preempted for them may be admitted again among the chunks: it leaves
        # the shards first. Prefill first, a preempted request may have its last chunk
        # in this prefill: it leaves after it.
        if plan.mixed:
            self._release_preempted(plan.preempted)
        if plan.chunks:
            self.lifecycle.admitted([chunk.seq for chunk in plan.chunks])
            task, sampled = self.shards.prefill(plan.chunks, stepping if mixed else (),
                                                plan.block_appends)
            by_id = {rid: (seq, seq.epoch) for rid, seq in stepping.items()} | {
                chunk.seq.id: (chunk.seq, chunk.epoch) for chunk in plan.chunks}
            sent.append(InFlight(task, "mixed" if mixed else "prefill",
                                 [by_id[rid] for rid in sampled], time.perf_counter(),
                                 sum(chunk.num_tokens for chunk in plan.chunks)))
        if not plan.mixed:
            self._release_preempted(plan.preempted)
        if plan.decoding and not mixed:
            decode = self.shards.decode(stepping, plan.block_appends, plan.speculative)
            assert decode is not None, "running requests that are not rows on the shards"
            task, rows = decode
            sent.append(InFlight.sent(task, "speculative" if plan.speculative else "decode",
                                      [stepping[rid] for rid in rows]))
        if sent:
            self.inflight.add(sent)
        elif not self.inflight:
            return False
        # Read the oldest steps until config.steps_in_flight iterations stay in flight
        # (all of them when nothing new could be sent, or after a speculative step: how
        # many tokens it emits decides the next step's blocks and guesses).
        keep = self.config.steps_in_flight if sent and not plan.speculative else 0
        while len(self.inflight) > keep:
            for call in self.inflight.oldest():
                # the token events queued so far go out first, once the calls just
                # created have sent their requests: the stream handlers write their
                # responses while the shards compute
                await asyncio.sleep(0)
                self.output.deliver()
                results = await self.inflight.read(call)
                if call.kind != "speculative":  # a verify step is no decode step's time
                    self.scheduler.prefill_budget.observe(call.prompt_tokens,
                                                          results.forward_s)
                self.lifecycle.apply(call.sampled, results)
        self._failed_at = None
        return True


def _metrics_state(status: EngineStatus, running_batch_size: int) -> dict[str, float]:
    """The engine's gauges for :class:`~router.metrics.Metrics`."""
    return {
        "queue_size": status.queue_size,
        "running_batch_size": running_batch_size,
        "kv_blocks_total": status.kv_blocks_total,
        "kv_blocks_used": status.kv_blocks_used,
        "prefix_cache_hit_tokens": status.prefix_cache_hit_tokens,
    }
