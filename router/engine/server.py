"""The engine's side of one API process (``--api-server-count``, :mod:`router.engine.ipc`).

:class:`ApiConnection` submits the requests an API process sends to the engine and
forwards their events back: each request's event stream is a :class:`ForwardedEvents`,
which the engine fills as it would fill a local reader's, and every event delivered in
one engine iteration leaves in one message, written without waiting (the socket's
buffer absorbs an API process that falls behind; the engine loop never waits for it).

Failures are logged and stay as small as they can: a message that fails here fails its
own request (the API process's client reads the error), an event that does not pickle
fails its own request, and a connection that fails or closes with requests open is
logged with how many requests it cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from typing import Any, cast

from loguru import logger

from router.engine.api import QueueFullError
from router.engine.ipc import BudgetsUpdate, EventItem, IpcError, messages, send, token_item
from router.engine.loop import Engine
from router.request import (
    ErrorEvent,
    Event,
    EventStream,
    GenerationRequest,
    HeldAnswer,
    Sequence,
)


def budgets_of(engine: Engine) -> BudgetsUpdate:
    """The budgets and KV capacity ``engine`` holds now, as an API process needs them."""
    manager = engine.block_manager
    return BudgetsUpdate(engine.config, manager.num_blocks, manager.block_size)


class ForwardedEvents(EventStream):
    """The event stream of a request whose reader is in an API process: what the engine
    puts on it goes to :meth:`ApiConnection.forward`. It has no reader here."""

    def __init__(self, connection: ApiConnection, rid: int) -> None:
        super().__init__()
        self._connection = connection
        self._rid = rid

    def put_nowait(self, event: Event) -> None:
        self._connection.forward(self._rid, event)

    def put_all(self, events: list[Event]) -> None:
        for event in events:
            self._connection.forward(self._rid, event)

    def put_answer(self, held: HeldAnswer) -> None:
        self._connection.forward_answer(self._rid, held)


class ApiConnection:
    """Serves one API process over its socket until it closes.

    Args:
        engine: The engine requests are submitted to.
        reader, writer: The socket's streams.
        name: The API process, for the log.
    """

    def __init__(self, engine: Engine, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, name: str) -> None:
        self.engine = engine
        self.name = name
        self._reader = reader
        self._writer = writer
        self._sequences: dict[int, Sequence] = {}
        self._outbox: list[EventItem] = []
        self._loop = asyncio.get_running_loop()
        self._calls: set[asyncio.Task[None]] = set()

    def forward(self, rid: int, event: Event) -> None:
        """Queue ``event`` of request ``rid`` for the API process; the queue leaves in
        one message once the engine's current iteration yields to the event loop."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(token_item(rid, event))
        if isinstance(event, ErrorEvent) or event.finish is not None:
            self._sequences.pop(rid, None)

    def forward_answer(self, rid: int, held: HeldAnswer) -> None:
        """Queue the whole answer of request ``rid`` (a request that does not stream),
        as the engine holds it: one item, its columns as they are."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append((rid, held))
        self._sequences.pop(rid, None)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        try:
            self._send(("events", outbox))  # pickled whole before anything is written
        except Exception as error:  # one event that does not pickle fails its request only
            logger.opt(exception=error).error("events for {} do not pickle", self.name)
            self._send(("events", [self._sendable(item) for item in outbox]))

    def _sendable(self, item: EventItem) -> EventItem:
        """``item``, or when it does not pickle an error event in its place (its request,
        if still running, is cancelled)."""
        try:
            pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            rid = cast(int, item[0])
            seq = self._sequences.pop(rid, None)
            if seq is not None:
                self.engine.cancel(seq)
            return token_item(rid, ErrorEvent(
                f"internal error: the answer could not be sent to the API process: {error!r}"))
        return item

    def _send(self, message: tuple[object, ...]) -> None:
        send(self._writer, message)

    def send_budgets(self) -> None:
        """Tell the API process the budgets and KV capacity in force."""
        self._send(("budgets", budgets_of(self.engine)))

    async def serve(self) -> None:
        """Read and apply the API process's messages until it closes its end or the
        socket fails (logged); then cancel its requests still running (logged)."""
        self.engine.on_replaced.append(self.send_budgets)
        try:
            async for message in messages(self._reader):
                self._apply(message)
        except IpcError as error:
            logger.error("the connection to {} failed: {}", self.name, error)
        finally:
            self.engine.on_replaced.remove(self.send_budgets)
            if self._sequences:
                logger.warning("{} is gone: cancelling its {} open request(s)", self.name,
                               len(self._sequences))
            for seq in self._sequences.values():
                self.engine.cancel(seq)
            self._sequences.clear()
            for task in self._calls:
                task.cancel()
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

    def _apply(self, message: tuple[Any, ...]) -> None:
        try:
            self._dispatch(message)
        except Exception as error:  # a failed message fails its request, not the others
            logger.opt(exception=error).error("a {!r} message of {} failed", message[0],
                                              self.name)
            if message[0] == "submit":
                self.forward(message[1], ErrorEvent(
                    f"internal error: {type(error).__name__}: {error}"))

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            self._submit(message[1], message[2])
        elif kind == "cancel":
            seq = self._sequences.pop(message[1], None)
            if seq is not None:
                self.engine.cancel(seq)
        elif kind == "rejected":
            self.engine.count_rejected()
        elif kind == "call":
            task = asyncio.ensure_future(self._answer(message[1], message[2]))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        else:
            logger.error("unknown message {!r} from {}", kind, self.name)

    def _submit(self, rid: int, request: GenerationRequest) -> None:
        try:
            seq = self.engine.submit(request, events=ForwardedEvents(self, rid))
        except QueueFullError as error:
            self.forward(rid, ErrorEvent(str(error), refusal=error.refusal))
            return
        self._sequences[rid] = seq

    async def _answer(self, call_id: int, name: str) -> None:
        try:
            if name == "health":
                value: object = await self.engine.health_problem()
            elif name == "status":
                value = self.engine.status()
            elif name == "metrics":
                value = self.engine.metrics.render()
            else:
                raise ValueError(f"unknown call {name!r}")
        except BaseException as error:
            # the caller gets an answer whatever happens: the failure, named
            self._send(("failed", call_id, isinstance(error, asyncio.CancelledError),
                        f"{type(error).__name__}: {error}"))
            if not isinstance(error, Exception):
                raise
            logger.opt(exception=error).error("the call {!r} of {} failed", name, self.name)
            return
        self._send(("reply", call_id, value))

