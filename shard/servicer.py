"""The gRPC servicer: protobuf → typed records → :class:`ModelRunner` → protobuf.

Model work runs in a worker thread (``asyncio.to_thread``) under one lock, so Health
and Info answer while a long forward is running. :func:`_status_for` is the one place
that maps exceptions to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from loguru import logger

from shard import pb_convert
from shard.errors import NotWarmedUpError
from shard.model_runner import ModelRunner
from shard.pb import shard_pb2 as pb
from shard.pb import shard_pb2_grpc
from shard.pending_step import PendingStep
from shard.records import StepOutput

T = TypeVar("T")


def _status_for(exc: BaseException) -> grpc.StatusCode:
    """ValueError → INVALID_ARGUMENT, no KV cache yet → FAILED_PRECONDITION, anything
    else → INTERNAL."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotWarmedUpError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Implements ``shardserve.shard.v1.ShardService`` over one :class:`ModelRunner`."""

    def __init__(self, runner: ModelRunner, step_wait_s: float = 60.0) -> None:
        self.runner = runner
        self.trace = runner.trace  # the runner's (shard.step_trace): one file per process
        self.lock = asyncio.Lock()
        self.log = logger.bind(rank=runner.config.rank)
        # Prefill/Decode ordering (PrefillRequest.step): the last step let through, and
        # the first step after the router's last restart (earlier ones are abandoned)
        self._last_step = 0
        self._abandon_below = 0
        self._step_turn = asyncio.Condition()
        self._step_wait_s = step_wait_s

    async def _restart_steps(self) -> None:
        """The router's step count starts again from 1 (Warmup)."""
        async with self._step_turn:
            self._last_step = 0
            self._abandon_below = 0
            self._step_turn.notify_all()

    async def _wait_turn(
        self, context: grpc.aio.ServicerContext, step: int, restart: bool
    ) -> None:
        """Hold a Prefill/Decode until every step before ``step`` has started (0 =
        unordered). A ``restart`` step runs without waiting for the steps before it:
        those that still wait, or arrive later, are abandoned (and the runner drops the
        requests it holds before it runs, see :meth:`_launch`).

        Aborts with FAILED_PRECONDITION when an earlier step never arrives within
        ``step_wait_s`` seconds (the router lost it, e.g. after a failure), or when the
        step was abandoned.
        """
        if step == 0:
            return
        async with self._step_turn:
            if restart:
                self._abandon_below = step
                self._last_step = max(self._last_step, step - 1)
                self._step_turn.notify_all()
            try:
                await asyncio.wait_for(
                    self._step_turn.wait_for(
                        lambda: step < self._abandon_below or self._last_step >= step - 1
                    ),
                    self._step_wait_s,
                )
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {step} waited {self._step_wait_s:.0f} s for step {step - 1}",
                )
            if step < self._abandon_below or step <= self._last_step:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {step} was abandoned: the router restarted at step "
                    f"{self._abandon_below}",
                )
            self._last_step = step
            self._step_turn.notify_all()

    async def _run(
        self,
        context: grpc.aio.ServicerContext,
        rpc: str,
        fn: Callable[[], T],
        locked: bool = True,
        abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn`` in a worker thread, under the lock unless ``locked`` is False;
        abort the RPC on error.

        NOTE: a cancelled RPC (deadline, client gone) cannot stop the thread, so the lock
        is held until the thread is done: the next step never runs beside it. What the
        thread returned then goes to ``abandoned`` (when given and the thread succeeded).
        """
        try:
            async with self.lock if locked else contextlib.nullcontext():
                work = asyncio.ensure_future(asyncio.to_thread(fn))
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:
                    await asyncio.wait({work})
                    if abandoned is not None and work.exception() is None:
                        abandoned(work.result())
                    raise
        except Exception as exc:
            code = _status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                self.log.exception("{} failed", rpc)
                message = f"{rpc}: internal error: {type(exc).__name__}: {exc}"
            else:
                self.log.warning("{} rejected ({}): {}", rpc, code.name, exc)
                message = f"{rpc}: {exc}"
            await context.abort(code, message)
            raise AssertionError("unreachable: context.abort raises") from exc

    async def _launch_then_finish(
        self,
        context: grpc.aio.ServicerContext,
        rpc: str,
        step: int,
        launch: Callable[[], PendingStep | StepOutput],
    ) -> StepOutput:
        """Launch a step under the lock, then wait for its results without it: the next
        step (already sent by the router) is launched while this one computes.

        NOTE: a step launched for an RPC cancelled meanwhile (deadline, client gone) is
        still read, in a worker thread: the steps after it wait for it in launch order.
        """
        launched = await self._run(context, rpc, launch, abandoned=self._finish_abandoned)
        self.trace.mark("launched", step)
        if not isinstance(launched, PendingStep):
            return launched
        pending = launched
        pending.trace_step = step
        return await self._run(
            context, rpc, lambda: self.runner.finish_step(pending), locked=False
        )

    def _finish_abandoned(self, launched: PendingStep | StepOutput) -> None:
        """Read, in a worker thread, the step launched for a cancelled RPC (see
        :meth:`_launch_then_finish`); nothing to do when it launched nothing."""
        if isinstance(launched, PendingStep):
            reading = asyncio.get_running_loop().run_in_executor(
                None, self.runner.finish_step, launched
            )
            reading.add_done_callback(self._log_failed_read)

    def _log_failed_read(self, reading: asyncio.Future[StepOutput]) -> None:
        if not reading.cancelled() and reading.exception() is not None:
            self.log.opt(exception=reading.exception()).error("reading an abandoned step failed")

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        return pb_convert.info_to_pb(self.runner.info())

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse()

    async def Warmup(
        self, request: pb.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> pb.WarmupResponse:
        num_blocks = await self._run(
            context,
            "Warmup",
            lambda: self.runner.warmup(
                request.max_batch_prefill_tokens, request.max_total_tokens, request.max_batch_size,
                hold_total=not request.max_total_tokens_derived,
            ),
        )
        await self._restart_steps()
        # The model, the graphs and the modules live as long as the process: kept out of
        # the collector's generations, a full collection no longer scans them (a pause
        # between two launches of the decode loop).
        gc.collect()
        gc.freeze()
        return pb.WarmupResponse(num_blocks=num_blocks, block_size=self.runner.block_size)

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        t0 = time.perf_counter_ns()
        step = request.step
        await self._wait_turn(context, step, request.restart)
        out = await self._launch_then_finish(
            context,
            "Prefill",
            step,
            self._launch(request.restart, lambda: self.runner.launch_prefill(
                pb_convert.prefill_step_from_pb(request), step)),
        )
        self.trace.mark("prefill", step, out.forward_ns // 1000)
        return pb_convert.prefill_response_to_pb(out, time.perf_counter_ns() - t0,
                                                 request.decode)

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecodeResponse:
        t0 = time.perf_counter_ns()
        step = request.step
        self.trace.mark("arrive", step)
        await self._wait_turn(context, step, request.restart)
        out = await self._launch_then_finish(
            context,
            "Decode",
            step,
            self._launch(request.restart, lambda: self.runner.launch_decode(
                pb_convert.decode_step_from_pb(request))),
        )
        response = pb_convert.decode_response_to_pb(out, time.perf_counter_ns() - t0)
        response.step = step
        self.trace.mark("answer", step, out.forward_ns // 1000)
        return response

    def _launch(
        self, restart: bool, launch: Callable[[], PendingStep | StepOutput]
    ) -> Callable[[], PendingStep | StepOutput]:
        """``launch``, after dropping every request held when the step is a ``restart``
        (what the abandoned steps left is gone)."""
        if not restart:
            return launch

        def first() -> PendingStep | StepOutput:
            self.runner.reset()
            return launch()

        return first
