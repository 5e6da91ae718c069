"""Keep-alive connections outlive the idle time of clients' pools, so that a client never
sends a request on a connection the server is closing at that moment (the request would
get a reset, not an answer, and never reach the server's log); a request that starts
arriving on a kept connection still gets ``--header-timeout``.

Real server (``shardserve launch`` on the tiny model, one API process beside the engine,
as on a GPU), raw sockets.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.integration.live_server import LiveServer, launch_tiny

HEADER_TIMEOUT_S = 1.0
# How long httpx (and so the openai package) keeps an idle connection in its pool.
HTTPX_KEEPALIVE_EXPIRY_S = 5.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("keep-alive") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--api-server-count", "1",
                                                  "--header-timeout", str(HEADER_TIMEOUT_S)])
    yield live
    live.stop()


def connect(server: LiveServer) -> socket.socket:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def read_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a ``Content-Length`` body); b'' if the server
    closed the connection (or reset it) instead."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            chunk = sock.recv(4096)
            if not chunk:
                return b""
            body += chunk
    except ConnectionResetError:
        return b""
    return data


def test_an_idle_connection_outlives_the_clients_pool_expiry(server: LiveServer) -> None:
    sock = connect(server)
    try:
        sock.sendall(HEALTH)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        # idle longer than the header timeout and than httpx keeps the connection: the
        # client closes it first, so the server never closes one a request is racing to
        time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 1.0)
        sock.sendall(HEALTH)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_a_request_stalled_on_a_kept_connection_is_closed(server: LiveServer) -> None:
    sock = connect(server)
    try:
        sock.sendall(HEALTH)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers that never end
        sock.settimeout(HEADER_TIMEOUT_S + 20.0)  # fails only if never closed
        assert read_response(sock) == b""
    finally:
        sock.close()
