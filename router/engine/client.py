"""The engine as an API process sees it (``--api-server-count``, :mod:`router.engine.ipc`).

:class:`EngineClient` offers the API layer what :class:`router.engine.loop.Engine` offers it
(:class:`router.engine.api.EngineApi`), over the socket to the engine process: ``submit``
sends the request and returns at once; its events arrive in one message per engine
step and are put on the request's stream here, so the HTTP handlers read them as they
would read a local engine's. A refusal (429, 503) is the stream's only event.

Nothing is dropped without a word: when the socket fails or closes, every open request
ends with an error its client reads, and the log says why and how many; an event that
fails here fails its own request.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from router.config import SchedulerConfig
from router.engine.api import EngineStatus, EventSource
from router.engine.ipc import BudgetsUpdate, EventItem, IpcError, event_of, messages, send
from router.request import ErrorEvent, EventStream, GenerationRequest, HeldAnswer
from router.tokenizer import Tokenizer

ENGINE_GONE = "the engine process exited"


class EngineGoneError(RuntimeError):
    """The engine process closed its socket: nothing more can be asked of it."""


class EngineCallError(RuntimeError):
    """A call of the engine failed there (its type and message)."""


@dataclass(eq=False, slots=True)
class RemoteRequest:
    """A request submitted to the engine process: its id there and its events here."""

    id: int
    events: EventStream = field(default_factory=EventStream)


@dataclass(frozen=True)
class KvCapacityView:
    """The engine's KV cache size, as last reported."""

    num_blocks: int
    block_size: int


@dataclass
class BudgetsView:
    """The budgets requests are validated against (:class:`router.validation.Budgets`),
    as the engine last reported them."""

    config: SchedulerConfig
    block_manager: KvCapacityView

    def update(self, update: BudgetsUpdate) -> None:
        self.config = update.config
        self.block_manager = KvCapacityView(update.num_blocks, update.block_size)


class EngineClient(EventSource):
    """Proxy of the engine in another process.

    Args:
        reader, writer: The socket to the engine process.
        tokenizer: The model's tokenizer (validation and the APIs' token texts).
        budgets: The budgets in force at start-up.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 tokenizer: Tokenizer, budgets: BudgetsUpdate) -> None:
        self.tokenizer = tokenizer
        self.budgets = BudgetsView(budgets.config, KvCapacityView(0, 0))
        self.budgets.update(budgets)
        self._reader = reader
        self._writer = writer
        self._streams: dict[int, EventStream] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self.gone = False

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler's budgets in force."""
        return self.budgets.config

    def _send(self, message: tuple[object, ...]) -> None:
        send(self._writer, message)

    def submit(self, request: GenerationRequest) -> RemoteRequest:
        """Send ``request`` to the engine; its events (or its refusal) arrive on the
        returned handle's ``events``."""
        handle = RemoteRequest(next(self._ids))
        if self.gone:
            handle.events.put_nowait(ErrorEvent(ENGINE_GONE))
            return handle
        self._streams[handle.id] = handle.events
        self._send(("submit", handle.id, request))
        return handle

    def cancel(self, seq: RemoteRequest) -> None:
        """Abort ``seq`` (its client left); no-op once it ended."""
        if self._streams.pop(seq.id, None) is not None:
            self._send(("cancel", seq.id))

    def count_rejected(self) -> None:
        """Count a request the API refused before submitting it."""
        self._send(("rejected",))

    async def _call(self, name: str) -> Any:
        if self.gone:
            raise EngineGoneError(ENGINE_GONE)
        call_id = next(self._call_ids)
        reply = asyncio.get_running_loop().create_future()
        self._replies[call_id] = reply
        self._send(("call", call_id, name))
        try:
            return await reply
        finally:
            self._replies.pop(call_id, None)

    async def health_problem(self) -> str | None:
        """The engine's answer (:meth:`router.engine.loop.Engine.health_problem`)."""
        try:
            problem: str | None = await self._call("health")
        except EngineGoneError:
            return ENGINE_GONE
        return problem

    async def snapshot(self) -> EngineStatus:
        """The engine's status now.

        Raises:
            EngineGoneError: the engine process has exited.
        """
        status: EngineStatus = await self._call("status")
        return status

    async def render_metrics(self) -> bytes:
        """The engine's Prometheus exposition.

        Raises:
            EngineGoneError: the engine process has exited.
        """
        text: bytes = await self._call("metrics")
        return text

    async def run(self) -> None:
        """Dispatch the engine's messages until it closes the socket or the socket fails
        (logged); then every request still open ends with an :class:`ErrorEvent`
        (logged)."""
        try:
            async for message in messages(self._reader):
                try:
                    self._apply(message)
                except Exception as error:
                    logger.opt(exception=error).error("a {!r} message from the engine "
                                                      "failed", message[0])
        except IpcError as error:
            logger.error("the connection to the engine process failed: {}", error)
        finally:
            self.gone = True
            if self._streams:
                logger.error("the engine process is gone: failing {} open request(s)",
                             len(self._streams))
            for events in self._streams.values():
                events.put_nowait(ErrorEvent(ENGINE_GONE))
            self._streams.clear()
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(EngineGoneError(ENGINE_GONE))

    def _apply(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "events":
            self._deliver(message[1])
        elif kind == "reply":
            reply = self._replies.get(message[1])
            if reply is not None and not reply.done():
                reply.set_result(message[2])
        elif kind == "failed":
            reply = self._replies.get(message[1])
            if reply is not None and not reply.done():
                # a call cancelled there raises as one cancelled here (see CancelledAsError)
                reply.set_exception(asyncio.CancelledError(message[3]) if message[2]
                                    else EngineCallError(message[3]))
        elif kind == "budgets":
            self.budgets.update(message[1])
        else:
            logger.error("unknown message {!r} from the engine", kind)

    def _deliver(self, items: list[EventItem]) -> None:
        streams = self._streams
        for item in items:
            rid = item[0]
            events = streams.get(rid)  # type: ignore[call-overload]
            if events is None:  # cancelled meanwhile
                continue
            try:
                ended = _put(events, item)
            except Exception as error:  # fails this request, not those after it
                logger.opt(exception=error).error("an event of request {} failed", rid)
                events.put_nowait(ErrorEvent(f"internal error: {type(error).__name__}: "
                                             f"{error}"))
                self._send(("cancel", rid))
                ended = True
            if ended:
                del streams[rid]  # type: ignore[arg-type]

    def close(self) -> None:
        """Close the socket (the engine then cancels this process's open requests)."""
        self._writer.close()


def _put(events: EventStream, item: EventItem) -> bool:
    """Put the event (or whole answer) of ``item`` on ``events``; whether it ends the
    request."""
    if len(item) == 2 and isinstance(item[1], HeldAnswer):  # a whole answer
        events.put_answer(item[1])
        return True
    event = event_of(item)
    events.put_nowait(event)
    return isinstance(event, ErrorEvent) or event.finish is not None
