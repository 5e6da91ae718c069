"""Request body size limit: an ASGI middleware answering 413 beyond ``max_bytes``.

A huge body would otherwise be read, parsed and tokenized on the event loop that also
drives generation, stalling every running stream.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.errors import send_error


class BodySizeLimit:
    """Reject HTTP request bodies larger than ``max_bytes`` with 413.

    Checks ``Content-Length`` up front (answering before the body is read) and counts
    the bytes of chunked bodies as they arrive. ``on_reject`` is called for each
    request refused up front (a chunked one is refused by the app's error handler).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, send)
            return
        received = 0

        async def counting_receive() -> Message:
            # A body without Content-Length (chunked): the app's error handlers turn
            # this HTTPException into the route's error shape.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (--max-request-bytes)"

    async def _reject(self, scope: Scope, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        await send_error(send, scope["path"], 413, f"body: {self._message()}", "validation",
                         param="body")
