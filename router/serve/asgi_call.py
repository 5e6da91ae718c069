"""An HTTP call carried from the ingress to a replica and answered by the replica's own
FastAPI app, in its process: the same routes, validation, errors and streams as
``shardserve launch`` serves.

The ingress sends an :class:`HttpCall` (method, path, headers, whole body); the replica
runs its ASGI app on it (:func:`run_asgi`) and streams back the response as
:class:`HttpStart` then body chunks (bytes), one per ASGI ``http.response.body``
message, so an SSE stream keeps its pace. Closing the stream early (the client went
away) tells the app ``http.disconnect``, which cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

# Seconds the app may take to end after the caller went away before it is cancelled.
DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request, read in full by the ingress.

    Attributes:
        method: ``GET``, ``POST`` ...
        path: The URL path (``/v1/chat/completions``).
        query_string: The raw query, bytes.
        headers: (name, value) pairs as bytes, names lower-case.
        body: The whole body, bytes.
        client: The client's (host, port), if known.
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class HttpStart:
    """The start of a response: its status and headers ((name, value) bytes pairs)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def _scope(call: HttpCall) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query_string,
        "headers": list(call.headers),
        "client": call.client,
        "server": ("127.0.0.1", 0),
    }


async def run_asgi(app: ASGIApp, call: HttpCall) -> AsyncIterator[HttpStart | bytes]:
    """Answer ``call`` with ``app``: one :class:`HttpStart`, then the body's chunks.

    Raises:
        Exception: what the app raised before it started a response (the app's own
            handlers answer every error they know as a response).
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(call), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield HttpStart(
                    message["status"],
                    tuple(
                        (bytes(name), bytes(value)) for name, value in message.get("headers", ())
                    ),
                )
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if task.done():
            task.result()  # the app's own error, when it answered nothing
    finally:
        gone.set()
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
        if not done:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
