"""gRPC client of the shard group: every call goes to every rank concurrently.

All ranks run the same batch (SPMD); rank 0's generations are returned. Any rank failing
fails the call with :class:`ShardError`, so the engine can end the affected requests.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from router.step_deadline import StepDeadline
from router.step_trace import NullTrace, Trace
from shard.pb import shard_pb2 as pb
from shard.pb import shard_pb2_grpc

T = TypeVar("T")

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
]


# What each RPC is, and what each status code means, in words a client understands.
_CALL_WORDS = {
    "Prefill": "while reading the prompt", "Decode": "while generating",
    "Health": "to a health check", "Info": "to an info request", "Warmup": "while warming up",
}
_CODE_WORDS = {
    grpc.StatusCode.UNAVAILABLE: "stopped responding (it may have crashed or be restarting)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ran out of memory",
    grpc.StatusCode.CANCELLED: "was interrupted",
}


class ShardError(RuntimeError):
    """A shard rank failed an RPC (crashed, unreachable or raised).

    ``str(error)`` carries gRPC's detail for the log; :attr:`public_message` says what
    failed in plain words, for clients (never transport internals such as
    ``recvmsg:Connection reset by peer``).
    """

    def __init__(self, rank: int, method: str, code: grpc.StatusCode | None, details: str):
        self.rank = rank
        self.code = code
        code_name = code.name if code is not None else "UNKNOWN"
        what = _CODE_WORDS.get(code, "failed") if code is not None else "failed"
        when = _CALL_WORDS.get(method, f"on {method}")
        self.public_message = f"model shard {rank} {what} {when}; see the server log"
        super().__init__(f"shard rank {rank} failed {method}: {code_name}: {details}")


class ShardClient:
    """Stubs of every rank of one shard group.

    Args:
        addresses: ``host:port`` of each rank, in rank order.
        deadline: Deadline of Prefill/Decode calls (a hung rank becomes an error instead
            of a hang); adaptive by default (see :mod:`router.step_deadline`).
        trace: Where each Decode's ``send`` and ``recv`` go (:mod:`router.step_trace`);
            none by default.

    Attributes:
        hung_rank: The rank whose Prefill or Decode ran past the deadline, once one did
            (the group is then stuck: the launcher restarts it).
    """

    def __init__(self, addresses: Sequence[str], deadline: StepDeadline | None = None,
                 trace: Trace | None = None) -> None:
        if not addresses:
            raise ValueError("a shard group needs at least one address")
        self.addresses = list(addresses)
        self.deadline = deadline if deadline is not None else StepDeadline()
        self.trace = trace if trace is not None else NullTrace()
        self.hung_rank: int | None = None
        self._channels = [
            grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) for address in addresses
        ]
        self._stubs = [shard_pb2_grpc.ShardServiceStub(channel) for channel in self._channels]
        # Prefill/Decode step numbers, in the order the calls are made (see "One key per
        # step" in proto/shard.proto); warmup() restarts them. The next step is marked
        # restart after restart_steps().
        self._steps = itertools.count(1)
        self._restart = False

    async def close(self) -> None:
        """Close every channel."""
        await asyncio.gather(*(channel.close() for channel in self._channels))

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every rank answers Health.

        Raises:
            ShardError: a rank did not answer within ``timeout_s`` seconds.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        for rank, stub in enumerate(self._stubs):
            while True:
                try:
                    await stub.Health(pb.HealthRequest(), timeout=5.0)
                    break
                except grpc.aio.AioRpcError as error:
                    if asyncio.get_running_loop().time() > deadline:
                        raise ShardError(
                            rank, "Health", error.code(), error.details() or ""
                        ) from error
                    await asyncio.sleep(0.2)

    async def _all(
        self, method: str, call: Callable[[shard_pb2_grpc.ShardServiceStub], Awaitable[T]]
    ) -> list[T]:
        """Call every rank concurrently; results in rank order.

        Fails as soon as any rank fails (not after the ranks before it): a dead rank
        leaves the others blocked in a collective until their deadline, and the caller
        must not wait for that.

        Raises:
            ShardError: the first rank to fail (the others' calls are cancelled); also
                when a call is cancelled under the caller (CANCELLED: this client's
                channels were closed, as a shard-group restart does).
        """
        tasks = [asyncio.ensure_future(call(stub)) for stub in self._stubs]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.cancelled():
                        raise ShardError(tasks.index(task), method, grpc.StatusCode.CANCELLED,
                                         "the call was cancelled (the channel was closed)")
                    error = task.exception()
                    if isinstance(error, grpc.aio.AioRpcError):
                        rank = tasks.index(task)
                        raise ShardError(
                            rank, method, error.code(), error.details() or ""
                        ) from error
                    if error is not None:
                        raise error
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()

    async def info(self) -> list[pb.InfoResponse]:
        """Info of every rank."""
        return await self._all("Info", lambda s: s.Info(pb.InfoRequest(), timeout=30.0))

    async def health(self) -> None:
        """Raise :class:`ShardError` unless every rank is healthy."""
        await self._all("Health", lambda s: s.Health(pb.HealthRequest(), timeout=5.0))

    async def warmup(
        self, max_batch_prefill_tokens: int, max_total_tokens: int, max_batch_size: int = 0,
        max_total_tokens_derived: bool = False,
    ) -> int:
        """Warm every rank up (``max_batch_size`` > 0 sizes the decode CUDA graphs);
        return the KV block count usable by all (the minimum). With
        ``max_total_tokens_derived`` (no ``--max-total-tokens`` given) the cache need not
        hold one request of ``max_total_tokens``: the default is lowered to what it holds.

        Its duration counts as a step of the adaptive deadline (Warmup runs the
        worst-case prefill).
        """
        request = pb.WarmupRequest(
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_total_tokens=max_total_tokens,
            max_batch_size=max_batch_size,
            max_total_tokens_derived=max_total_tokens_derived,
        )
        self._steps = itertools.count(1)
        started = time.perf_counter()
        responses = await self._all("Warmup", lambda s: s.Warmup(request, timeout=1800.0))
        self.deadline.observe(time.perf_counter() - started)
        return min(response.num_blocks for response in responses)

    async def _step(
        self, method: str,
        call: Callable[[shard_pb2_grpc.ShardServiceStub, float], Awaitable[T]],
    ) -> T:
        """A Prefill or Decode on every rank under the step deadline; rank 0's response.

        Raises:
            ShardError: a rank failed, or did not answer within the deadline (then
                :attr:`hung_rank` is set).
        """
        timeout = self.deadline.seconds
        started = time.perf_counter()
        try:
            responses = await self._all(method, lambda stub: call(stub, timeout))
        except ShardError as error:
            if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self.hung_rank = error.rank
            raise ShardError(
                error.rank, method, error.code,
                f"no answer within {timeout:.1f} s (--step-timeout); the shard group is hung",
            ) from error
        self.deadline.observe(time.perf_counter() - started)
        return responses[0]

    def restart_steps(self) -> None:
        """Mark the next step ``restart`` (after a failed step, whose steps in flight are
        abandoned): every rank gives up the earlier steps and drops the requests it
        holds before running it."""
        self._restart = True

    def _number(self, request: pb.PrefillRequest | pb.DecodeRequest) -> None:
        request.step = next(self._steps)
        request.restart, self._restart = self._restart, False

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """Send ``request`` (its step number set here) to every rank; rank 0's response."""
        self._number(request)
        return await self._step("Prefill", lambda s, timeout: s.Prefill(request, timeout=timeout))

    async def decode(self, request: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        """Send ``request`` (its step number set here) to every rank; rank 0's response.
        ``num_rows``: the rows it steps, for the step trace."""
        self._number(request)
        self.trace.mark("send", request.step, num_rows)
        response = await self._step(
            "Decode", lambda s, timeout: s.Decode(request, timeout=timeout))
        self.trace.mark("recv", request.step)
        return response
