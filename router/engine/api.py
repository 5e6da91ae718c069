"""What the HTTP and public gRPC APIs see of the engine: the protocol they call
(:class:`EngineApi`, met by :class:`router.engine.loop.Engine` in the same process and by
:class:`router.engine.client.EngineClient` in an API process), the refusals ``submit``
raises, and the status snapshot."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from router.config import SchedulerConfig
from router.request import (
    ErrorEvent,
    Event,
    EventStream,
    GenerationRequest,
    HeldAnswer,
    Refusal,
)
from router.tokenizer import Tokenizer


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
    process, or :class:`router.engine.client.EngineClient` in an API process."""

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
    API process's proxy of it (:class:`router.engine.client.EngineClient`)."""

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
        speculative_proposed: Guesses proposed by speculative decoding so far.
        speculative_accepted: Guesses accepted so far.
    """

    draining: bool
    healthy: bool
    queue_size: int
    running: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hit_tokens: int
    speculative_proposed: int = 0
    speculative_accepted: int = 0

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free
