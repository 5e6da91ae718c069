"""The wire between the engine process and its API processes (``--api-server-count``).

One Unix stream socket per API process (a ``socketpair`` made by the engine process,
whose one end the API process inherits). Each message is a 4-byte big-endian length and
a pickled tuple whose first item names it; both ends are this package, on one machine,
over a socket no one else can open.

API process → engine:
    ``("submit", rid, GenerationRequest)``: a new request; ``rid`` is the API process's
        id for it.
    ``("cancel", rid)``: its client left.
    ``("rejected",)``: the API refused a request before submitting it (counted in
        ``shardserve_requests_total{outcome="rejected"}``).
    ``("call", call_id, name)``: ``name`` in :data:`CALLS`; answered by ``("reply",
        call_id, value)``.

Engine → API process:
    ``("events", [item, ...])``: the token events delivered to that process's requests
        since the last such message, in order: one message per engine step (see
        :func:`token_item`); a request that does not stream gets its whole answer as
        one item at its end, in the form the engine held it.
    ``("budgets", BudgetsUpdate)``: the token budgets and KV capacity in force (sent at
        start-up and after each shard-group restart).
    ``("reply", call_id, value)``, or ``("failed", call_id, cancelled, message)`` when
        the call raised there.

Token events travel as tuples of plain values, cheaper to pickle than the event objects.

A socket closed between two messages is the other end leaving; one reset, or closed in
the middle of a message, or a message that does not unpickle, is a failure
(:class:`IpcError`), which each end logs with the requests it fails.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.config import SchedulerConfig
from router.request import ErrorEvent, Event, TokenEvent

_LENGTH = struct.Struct("!I")

# Calls an API process makes of the engine: the answers /health, /info and /metrics need.
CALLS = ("health", "status", "metrics")

# An event on the wire: (rid, id, logprob, text, special, top_tokens, finish,
# prompt_logprobs) for a token, (rid, ErrorEvent) for a failure or a refusal, and
# (rid, HeldAnswer) for the whole answer of a request that does not stream.
EventItem = tuple[object, ...]


@dataclass(frozen=True)
class BudgetsUpdate:
    """The budgets requests are validated against, as the engine holds them now.

    Attributes:
        config: The scheduler's budgets (derived from the last Warmup).
        num_blocks: KV blocks on every rank.
        block_size: Tokens per KV block.
    """

    config: SchedulerConfig
    num_blocks: int
    block_size: int


class IpcError(RuntimeError):
    """The socket to the other process failed: reset, cut in the middle of a message, or
    a message that does not unpickle."""


def encode(message: tuple[object, ...]) -> bytes:
    """``message`` as one frame: its pickled length, then the pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def send(writer: asyncio.StreamWriter, message: tuple[object, ...]) -> None:
    """Write ``message`` without waiting (a no-op once the socket is closing).

    Raises:
        Exception: what pickling ``message`` raises (nothing is written then).
    """
    if not writer.is_closing():
        writer.write(encode(message))


async def messages(reader: asyncio.StreamReader) -> AsyncIterator[tuple[object, ...]]:
    """The messages of ``reader`` until the other end closes the socket between two
    messages.

    Raises:
        IpcError: the socket failed (see :func:`read_message`).
    """
    while True:
        try:
            yield await read_message(reader)
        except asyncio.IncompleteReadError as error:
            if error.partial:
                raise IpcError(f"the socket closed in the middle of a message "
                               f"({len(error.partial)} of {error.expected} bytes)") from error
            return


async def read_message(reader: asyncio.StreamReader) -> tuple[object, ...]:
    """The next message of ``reader``.

    Raises:
        asyncio.IncompleteReadError: the other end closed the socket (``partial`` empty
            when it did so between two messages).
        IpcError: the socket was reset, or the message does not unpickle.
    """
    header = await _read(reader, _LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    try:
        body = await _read(reader, length)
    except asyncio.IncompleteReadError as error:  # count the header's bytes too
        raise asyncio.IncompleteReadError(header + error.partial,
                                          _LENGTH.size + length) from error
    try:
        message: tuple[object, ...] = pickle.loads(body)
    except Exception as error:
        raise IpcError(f"a message of {length} bytes does not unpickle: {error!r}") from error
    return message


async def _read(reader: asyncio.StreamReader, size: int) -> bytes:
    try:
        return await reader.readexactly(size)
    except OSError as error:  # a reset, or a failed write (asyncio logs it in debug mode only)
        raise IpcError(f"the socket failed: {error!r}") from error


def token_item(rid: int, event: Event) -> EventItem:
    """``event`` of request ``rid`` as it travels."""
    if isinstance(event, ErrorEvent):
        return (rid, event)
    return (rid, event.id, event.logprob, event.text, event.special, event.top_tokens,
            event.finish, event.prompt_logprobs, event.token_text)


def event_of(item: EventItem) -> Event:
    """The event a token or error ``item`` (from :func:`token_item`) carries."""
    if len(item) == 2:
        event = item[1]
        assert isinstance(event, ErrorEvent)
        return event
    return TokenEvent(*item[1:])  # type: ignore[arg-type]
