"""SIGTERM with requests that outlast ``--graceful-timeout``: before the HTTP server
gives up on them, they are failed with a message that says so — a non-streaming client
gets a JSON error, a streaming client an error event that ends its stream — rather than
a plain-text 500 and a cut connection, with a traceback in the log for each.

Real server (``shardserve launch`` on the tiny model, local executor), real HTTP client.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.live_server import LiveServer, launch_tiny

# Enough tokens to outlast a 1 s graceful timeout by far on any machine.
LONG = {"max_new_tokens": 480, "ignore_eos": True}


def wait_running(server: LiveServer, count: int, timeout_s: float = 60.0) -> None:
    """Wait until ``count`` requests decode (``shardserve_running_batch_size``): on a
    loaded machine the blocking clients' requests may reach the server after the
    streaming one has had its first tokens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name == "shardserve_running_batch_size" and float(value) >= count:
                return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests never ran together")


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_requests_past_the_graceful_timeout_end_with_a_clear_error(
    tiny_model_dir: Path, tmp_path: Path, api_servers: str
) -> None:
    """With the APIs in the engine's process, and in an API process beside it."""
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--graceful-timeout", "1", "--api-server-count", api_servers])
    try:
        answers: dict[str, httpx.Response] = {}

        def post(path: str, body: dict[str, object]) -> None:
            answers[path] = httpx.post(f"{server.url}{path}", json=body, timeout=120)

        blocking = [
            threading.Thread(target=post, args=("/generate",
                                                {"inputs": "a b", "parameters": LONG})),
            threading.Thread(target=post, args=("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "a b"}],
                "max_tokens": LONG["max_new_tokens"], "ignore_eos": True})),
        ]
        for thread in blocking:
            thread.start()
        events: list[dict[str, object]] = []
        with httpx.stream("POST", f"{server.url}/generate_stream", timeout=120,
                          json={"inputs": "a b", "parameters": LONG}) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(json.loads(line[5:]))
                if len(events) == 2:
                    wait_running(server, len(blocking) + 1)
                    server.process.send_signal(signal.SIGTERM)
        for thread in blocking:
            thread.join(timeout=120)

        assert "error" in events[-1], events[-1]
        assert "shut down" in str(events[-1]["error"])
        assert len(events) < LONG["max_new_tokens"]
        for path, answer in answers.items():
            assert answer.headers["content-type"] == "application/json", (path, answer.text)
            assert "shut down" in answer.text, (path, answer.text)
        assert server.process.wait(timeout=60) == 0
        assert "Exception in ASGI application" not in server.log()
    finally:
        server.stop()
