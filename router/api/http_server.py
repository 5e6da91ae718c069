"""The uvicorn server of the HTTP API, with deadlines for request headers and bodies.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``) but nothing bounds a connection that never finishes sending a
request: a fresh connection that sends nothing, headers trickled in byte by byte, or a
body that stops short of its ``Content-Length`` stays open for ever, holds a file
descriptor and (a body) a handler waiting for it, which also holds up a graceful
shutdown. :class:`HeaderTimeoutProtocol` gives every request ``header_timeout_s``
seconds, from the connection's opening (or, on a keep-alive connection, the request's
first byte), to deliver its complete headers, then as long again for its body; past
either the connection is closed (the handler sees the client gone). A request that has
arrived whole is never cut by it, however long its answer streams.

Requests are parsed by httptools (llhttp, in C), uvicorn's fast parser: a burst of 256
requests reached a minimal app's handlers in half the time h11's pure-Python parser took
on the lent GPU machine (``benchmarks/serving/arrival_probe.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from loguru import logger
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Seconds an idle keep-alive connection stays open after a response (nginx's default).
# NOTE: it must outlast the idle time of the clients' pools (httpx and the openai package
# keep a connection 5 s, aiohttp 15 s): a server that closes first races the client's
# next request on that connection, which then gets a reset, not an answer, and never
# reaches the app (nothing logged). uvicorn's default, 5 s, is httpx's.
KEEP_ALIVE_S = 75
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Pending connections the listening socket queues (uvicorn's default).
HTTP_BACKLOG = 2048


class HttpConfig(uvicorn.Config):
    """uvicorn's configuration plus ``header_timeout_s`` (seconds), which
    :class:`HeaderTimeoutProtocol` reads."""

    def __init__(self, app: ASGIApp, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on receiving each request's headers
    and body.

    The header deadline is armed when the connection opens and when the first byte of a
    later request arrives; once a request's headers are complete the body deadline
    replaces it, and it is disarmed when the whole request has arrived. A keep-alive
    connection idle between requests is uvicorn's to close (``KEEP_ALIVE_S``).
    """

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout_s: float = getattr(config, "header_timeout_s",
                                               DEFAULT_HEADER_TIMEOUT_S)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_deadline()

    def on_message_begin(self) -> None:
        if self._deadline is None:  # a request after a response (a new connection's is armed)
            self._arm_deadline()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm_deadline()
        super().on_headers_complete()
        # the body gets a deadline of its own (on_message_complete disarms it; for a
        # request without a body that comes within the same parse)
        self._arm_deadline()

    def on_message_complete(self) -> None:
        self._disarm_deadline()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def _arm_deadline(self) -> None:
        self._disarm_deadline()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._on_deadline)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request headers or "
                         "body in {} s (--header-timeout)", self.header_timeout_s)
            self.transport.close()


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher installs handlers that ask
    it to exit, so shutdown runs our clean-up instead of re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_http_server(
    app: ASGIApp, host: str, port: int, header_timeout_s: float, graceful_timeout_s: int
) -> HttpServer:
    """The HTTP server of ``app`` on ``host:port``.

    Args:
        header_timeout_s: Seconds a client has to send a request's complete headers,
            and as long again for its body.
        graceful_timeout_s: Seconds open requests get to finish once asked to exit.
    """
    return HttpServer(
        HttpConfig(app, header_timeout_s=header_timeout_s, host=host, port=port,
                   log_level="warning", lifespan="off", http=HeaderTimeoutProtocol,
                   timeout_keep_alive=KEEP_ALIVE_S,
                   timeout_graceful_shutdown=graceful_timeout_s)
    )


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``SO_REUSEADDR``), inheritable by child
    processes (the API processes share it).

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(HTTP_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
