"""Idle and half-open HTTP connections, and requests whose body stalls, are closed after
``--header-timeout``; requests that arrived in time (and long streams) are not cut."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.live_server import LiveServer, launch_tiny

HEADER_TIMEOUT_S = 1.0
# Tokens of the long streams: enough that even a fast machine streams them for several
# header timeouts (a 2-core machine makes about 500 tokens/s of the tiny model).
LONG_STREAM_TOKENS = 3000


@pytest.fixture(scope="module")
def server(
    tiny_long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("idle") / "server.log"
    live = launch_tiny(tiny_long_model_dir, log_path, ["--header-timeout", str(HEADER_TIMEOUT_S)],
                       budgets=["--executor", "local", "--max-batch-prefill-tokens", "256",
                                "--max-total-tokens", "4096", "--kv-cache-bytes", "8MiB"])
    yield live
    live.stop()


def connect(server: LiveServer) -> socket.socket:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` seconds (EOF or reset)."""
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_half_open_connections_are_closed(server: LiveServer) -> None:
    idle = [connect(server) for _ in range(100)]
    partial = [connect(server) for _ in range(50)]
    for sock in partial:  # headers that never end
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    started = time.monotonic()
    try:
        for sock in idle + partial:
            remaining = HEADER_TIMEOUT_S + 5.0 - (time.monotonic() - started)
            assert closed_by_server(sock, max(remaining, 0.1))
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5.0
    finally:
        for sock in idle + partial:
            sock.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_trickled_headers_get_the_deadline_not_a_reset_per_byte(server: LiveServer) -> None:
    sock = connect(server)
    try:
        started = time.monotonic()
        sock.settimeout(0.2)
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except ConnectionResetError:  # closed while our next bytes were in flight
                closed = True
                break
            except TimeoutError:
                pass
        assert closed and time.monotonic() - started < HEADER_TIMEOUT_S + 3.0
    finally:
        sock.close()


def test_stalled_bodies_are_closed_and_other_requests_go_on(server: LiveServer) -> None:
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).encode()
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    stalled = [connect(server) for _ in range(20)]
    started = time.monotonic()
    try:
        for sock in stalled:  # complete headers, then half the body, then nothing
            sock.sendall(head + body[: len(body) // 2])
        # a request that sends its body in time is served meanwhile
        assert httpx.post(f"{server.url}/generate", content=body, timeout=30,
                          headers={"Content-Type": "application/json"}).status_code == 200
        for sock in stalled:
            remaining = HEADER_TIMEOUT_S + 5.0 - (time.monotonic() - started)
            assert closed_by_server(sock, max(remaining, 0.1))
    finally:
        for sock in stalled:
            sock.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    time.sleep(0.5)
    log = server.log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def test_requests_in_time_and_long_streams_are_served(server: LiveServer) -> None:
    # Keep-alive: a second request on the same connection, after a pause shorter than
    # the keep-alive timeout but longer than the header timeout's half.
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        time.sleep(HEADER_TIMEOUT_S / 2)
        assert client.get("/health").status_code == 200
        # A stream that lasts longer than the header timeout is not cut.
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
        started, events = time.monotonic(), []
        with client.stream("POST", "/generate_stream", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    time.sleep(0.005)  # a slow reader
        assert time.monotonic() - started > HEADER_TIMEOUT_S
        assert len(events) == 400 and events[-1]["details"]["generated_tokens"] == 400


def test_pipelined_long_request_is_not_cut(server: LiveServer) -> None:
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": LONG_STREAM_TOKENS,
                                                      "ignore_eos": True}}).encode()
    stream = (b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock = connect(server)
    try:
        # Both requests in one write: uvicorn starts the second as the first one ends.
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + stream)
        received, started = b"", time.monotonic()
        sock.settimeout(30)
        while f'"generated_tokens":{LONG_STREAM_TOKENS}'.encode() not in received:
            chunk = sock.recv(4096)
            assert chunk, f"closed after {time.monotonic() - started:.1f} s"
            received += chunk
            time.sleep(0.01)  # a slow reader keeps the stream longer than the timeout
        assert time.monotonic() - started > HEADER_TIMEOUT_S
    finally:
        sock.close()
