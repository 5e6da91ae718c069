"""Protocol-neutral generation: run one or several requests on the engine.

Every API (TGI HTTP, OpenAI HTTP, public gRPC) validates into
:class:`~router.request.GenerationRequest` and then uses these helpers, so results and
failures mean the same everywhere. ``n`` / ``best_of`` run as independent requests
(one per sequence) submitted together, so they share prefill through the prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from router.engine.api import EngineApi, RequestHandle, refusal_error
from router.request import (
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
    GenerationRequest,
    HeldAnswer,
    TokenEvent,
)
from router.validation import public_seed

T = TypeVar("T")


class GenerationFailed(RuntimeError):
    """A request failed after it was accepted (a shard failed)."""


class GrammarFailed(GenerationFailed):
    """A request's grammar failed during generation (a limit of the grammar engine):
    its input is at fault, not the server."""


@dataclass
class Completion:
    """One finished sequence.

    Attributes:
        request: The request that produced it.
        events: Its token events, in order, as they came one by one; empty when the
            engine handed the answer over whole (``answer``).
        answer: The whole answer as the engine held it, for a request that did not
            stream; its events are built only when :attr:`tokens` is read.
        finish: Why it ended (on the last token).
    """

    request: GenerationRequest
    events: list[TokenEvent] = field(default_factory=list)
    answer: HeldAnswer | None = None
    finish: Finish | None = None

    def add(self, event: TokenEvent | HeldAnswer) -> None:
        """Take the next token event, or the whole answer."""
        if isinstance(event, HeldAnswer):
            self.answer = event
        else:
            self.events.append(event)
        if event.finish is not None:
            self.finish = event.finish

    @property
    def tokens(self) -> list[TokenEvent]:
        """Every token event, in order (a whole answer's built at the first read)."""
        if self.answer is not None:  # the answer came whole: no event came before it
            self.events, self.answer = self.answer.events(), None
        return self.events

    @property
    def text(self) -> str:
        """Generated text; ends with the matched stop sequence (TGI semantics)."""
        if self.answer is not None:
            return self.answer.text
        return "".join(token.text for token in self.tokens)

    @property
    def seed(self) -> int | None:
        """The seed to report (None when greedy)."""
        return public_seed(self.request)

    @property
    def prompt_logprobs(self) -> tuple[float, ...]:
        """Logprobs of prompt tokens 1.. (``len(prompt) - 1`` values) when requested."""
        if self.answer is not None:
            return self.answer.event(0).prompt_logprobs if len(self.answer) else ()
        return self.tokens[0].prompt_logprobs if self.tokens else ()

    @property
    def logprob_sum(self) -> float:
        """Total logprob of the generated tokens (best_of ranks by it)."""
        if self.answer is not None:
            return self.answer.logprob_sum
        return sum(token.logprob for token in self.tokens)

    @property
    def num_generated(self) -> int:
        """Generated tokens."""
        if self.finish is not None:
            return self.finish.generated_tokens
        return len(self.tokens)


def text_without_stop(text: str, finish: Finish | None) -> str:
    """OpenAI semantics: ``text`` without the stop sequence (or stop token) that ended it."""
    if finish is None or finish.reason is not FinishReason.STOP_SEQUENCE:
        return text
    stop = finish.stop_sequence
    if stop and text.endswith(stop):
        return text[: -len(stop)]
    return text


def failure(event: ErrorEvent) -> Exception:
    """What a stream reader raises for ``event``: the refusal it carries
    (``QueueFullError``, ``ShuttingDownError``) or :class:`GenerationFailed`."""
    if event.grammar:
        return GrammarFailed(event.message)
    return refusal_error(event) or GenerationFailed(event.message)


class ClientDisconnected(RuntimeError):
    """The client went away before its (non-streaming) answer was ready."""


# Pause between two reads of the ASGI channel when a read returns something other than
# the disconnect (a server whose receive does not block once the body is read), seconds.
DISCONNECT_POLL_S = 0.25

# Returns once the client has gone (see :func:`client_gone`).
ClientGone = Callable[[], Awaitable[None]]


def client_gone(request: Request) -> ClientGone:
    """A waiter on ``request``'s ASGI channel that returns at its ``http.disconnect``.

    Once the body has been read, the server's ``receive`` (ASGI HTTP spec) blocks until
    the client disconnects or the response is complete, so one waiting task per request
    watches the client at no cost per step (polling ``Request.is_disconnected`` for
    every request costs the event loop ~0.1 ms a call).
    """

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_S)

    return wait


async def run_all(
    engine: EngineApi,
    requests: Sequence[GenerationRequest],
    gone: ClientGone | None = None,
    token_texts: bool = True,
) -> list[Completion]:
    """Run ``requests`` concurrently to completion; results in the same order.

    Args:
        gone: Returns once the client has left (:func:`client_gone`); the requests are
            then cancelled (freeing their KV blocks) and ClientDisconnected is raised.
        token_texts: The caller reads each token's text (TGI ``details``, completions
            ``logprobs``). When False and a request has no stop strings, its text is
            decoded once at the end and carried by its last event (the others have '').

    Raises:
        QueueFullError: the engine refused one (the others are cancelled).
        GenerationFailed: one failed after acceptance.
        ClientDisconnected: see ``gone``.
    """
    completions = [Completion(request) for request in requests]
    # the answer is sent whole: the engine may hand the events over at the end
    requests = [dataclasses.replace(request, stream=False, token_texts=token_texts)
                for request in requests]

    async def collect() -> None:
        async with MergedStream(engine, requests) as stream:
            async for first in stream.items():
                # the events handed over together are taken in one go, not one iteration
                # each, and a whole answer as the engine held it
                for index, event in [first, *stream.take_ready_items()]:
                    completions[index].add(event)

    await _unless_gone(collect(), gone)
    return completions


async def first_event(events: AsyncIterator[T], gone: ClientGone | None) -> T:
    """The first item of ``events`` (a stream's first token), watching the client.

    A streaming request waits in the queue, then for its prefill, before the response
    starts; a client that leaves meanwhile must neither keep its place nor be
    prefilled. Once ``gone`` returns, the wait is cancelled (the caller then closes the
    stream, which cancels the requests) and ClientDisconnected is raised.

    Raises:
        ClientDisconnected: see above.
        StopAsyncIteration: ``events`` ended without an item.
        Exception: whatever ``events`` raises (QueueFullError, GenerationFailed).
    """
    return await _unless_gone(anext(events), gone)


async def _unless_gone(work: Awaitable[T], gone: ClientGone | None) -> T:
    """Await ``work``, cancelling it and raising ClientDisconnected once ``gone()``
    returns (or fails: the client's channel is then unusable)."""
    task = asyncio.ensure_future(work)
    watch = None if gone is None else asyncio.ensure_future(gone())
    waiting = {task} if watch is None else {task, watch}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected("the client disconnected")
    finally:
        pending = [t for t in waiting if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if watch is not None and watch.done() and not watch.cancelled():
            watch.exception()  # retrieved: a failed channel is a disconnect, not an error


@dataclass
class StartedStream:
    """A stream whose first event has arrived (see :func:`start_stream`).

    Attributes:
        stream: The requests' merged events; close it when done (``aclose``).
        events: Its iterator, past the first event.
        first: The first event.
    """

    stream: MergedStream
    events: AsyncIterator[tuple[int, TokenEvent]]
    first: tuple[int, TokenEvent]

    async def batches(self) -> AsyncIterator[list[tuple[int, TokenEvent]]]:
        """The events in order, the first included, grouped as they can be written:
        each group is one event and those that arrived meanwhile. Raises what the
        iteration raises (:class:`GenerationFailed`)."""
        item: tuple[int, TokenEvent] | None = self.first
        while item is not None:
            yield [item, *self.stream.take_ready()]
            item = await anext(self.events, None)


async def start_stream(
    engine: EngineApi, requests: Sequence[GenerationRequest], gone: ClientGone | None,
) -> StartedStream:
    """Submit ``requests`` as one stream and wait for its first event, so that a 429 or
    a queue wait comes before the response starts; a client that leaves meanwhile
    cancels them (see :func:`first_event`).

    Raises:
        QueueFullError: the engine refused a request.
        GenerationFailed: a request failed before its first token.
        ClientDisconnected: the client left first.
    """
    stream = MergedStream(engine, requests)
    await stream.__aenter__()
    events = aiter(stream)
    try:
        first = await first_event(events, gone)
    except BaseException:
        await stream.aclose()
        raise
    return StartedStream(stream, events, first)


class MergedStream:
    """Events of several requests, interleaved as they come: ``(index, TokenEvent)``.

    Use as an async context manager: leaving it (for example a client disconnecting)
    cancels every request still running, which frees its KV blocks within a step.
    Iteration raises :class:`GenerationFailed` on an :class:`ErrorEvent` and
    ``QueueFullError`` when the engine refuses a request. :meth:`take_ready` hands over
    the events that arrived meanwhile without waiting, so that a writer that fell behind
    sends them together.
    """

    def __init__(self, engine: EngineApi, requests: Sequence[GenerationRequest]) -> None:
        self._engine = engine
        self._requests = list(requests)
        self._queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
        self._held: tuple[int, Event | BaseException | None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(self._requests)
        # One request (the usual case) is read from its sequence directly, without a
        # pump task and a second queue between it and the reader.
        self._seq: RequestHandle | None = None
        self._ended = False

    async def __aenter__(self) -> MergedStream:
        if len(self._requests) > 1:
            self._tasks = [
                asyncio.create_task(self._pump(index, request))
                for index, request in enumerate(self._requests)
            ]
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every request still running."""
        if self._seq is not None and not self._ended:
            self._ended = True
            self._engine.cancel(self._seq)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        events = self._engine.generate(request)
        try:
            async for event in events:
                self._queue.put_nowait((index, event))
        except Exception as error:  # handed to the reader, which raises it
            self._queue.put_nowait((index, error))
        finally:
            await events.aclose()
            self._queue.put_nowait((index, None))

    def __aiter__(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        return self._events(self.items())

    def items(self) -> AsyncIterator[tuple[int, TokenEvent | HeldAnswer]]:
        """The iteration as it comes: a request that does not stream may end with its
        whole answer as one :class:`~router.request.HeldAnswer` (iterating the stream
        itself yields its events one by one)."""
        if len(self._requests) == 1:
            return self._iterate_one()
        return self._iterate()

    @staticmethod
    async def _events(
        items: AsyncIterator[tuple[int, TokenEvent | HeldAnswer]],
    ) -> AsyncIterator[tuple[int, TokenEvent]]:
        async for index, item in items:
            if isinstance(item, HeldAnswer):
                for event in item.events():
                    yield index, event
            else:
                yield index, item

    async def _iterate_one(self) -> AsyncIterator[tuple[int, TokenEvent | HeldAnswer]]:
        if self._seq is None:
            self._seq = self._engine.submit(self._requests[0])
        events = self._seq.events
        while not self._ended:
            event = await events.get()
            if isinstance(event, ErrorEvent):
                self._ended = True
                raise failure(event)
            self._ended = event.finish is not None
            yield 0, event

    async def _iterate(self) -> AsyncIterator[tuple[int, TokenEvent | HeldAnswer]]:
        while self._open:
            if self._held is not None:
                (index, item), self._held = self._held, None
            else:
                index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            elif isinstance(item, ErrorEvent):
                raise failure(item)
            else:
                yield index, item

    def take_ready(self) -> list[tuple[int, TokenEvent]]:
        """The token events that arrived already, in order, without waiting; an error
        is left for the iteration to raise."""
        return [(index, event) for index, item in self.take_ready_items()
                for event in (item.events() if isinstance(item, HeldAnswer) else (item,))]

    def take_ready_items(self) -> list[tuple[int, TokenEvent | HeldAnswer]]:
        """:meth:`take_ready` as :meth:`items` gives them (a whole answer as one)."""
        ready: list[tuple[int, TokenEvent | HeldAnswer]] = []
        if self._seq is not None:
            events = self._seq.events
            while not self._ended and not events.empty():
                if isinstance(events.peek(), ErrorEvent):
                    break
                event = events.get_nowait()
                assert isinstance(event, (TokenEvent, HeldAnswer))
                ready.append((0, event))
                self._ended = event.finish is not None
            return ready
        while self._held is None and not self._queue.empty():
            index, item = self._queue.get_nowait()
            if isinstance(item, TokenEvent):
                ready.append((index, item))
            elif item is None:  # one request's end
                self._open -= 1
            else:
                self._held = (index, item)
        return ready
