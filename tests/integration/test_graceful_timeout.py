"""SIGTERM and ``--graceful-timeout``: a running request gets the whole graceful
timeout to finish; one that outlasts it is failed with a message that says so — a
non-streaming client gets a JSON error, a streaming client an error event that ends its
stream, a gRPC client UNAVAILABLE (retry elsewhere) — rather than a plain-text 500 and a
cut connection, with a traceback in the log for each.

Real server (``shardserve launch`` on the tiny model, local executor), real HTTP and
gRPC clients, real signals. A request's length at SIGTERM is set by stopping the shard
process (SIGSTOP, for less than the liveness ping's 5 s) and resuming it (SIGCONT).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from router.pb import generate_pb2, generate_pb2_grpc
from tests.integration.live_server import LiveServer, launch_tiny

# Far more tokens than a request decodes before its shard is stopped.
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
        with contextlib.ExitStack() as stopped:
            with httpx.stream("POST", f"{server.url}/generate_stream", timeout=120,
                              json={"inputs": "a b", "parameters": LONG}) as stream:
                for line in stream.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events.append(json.loads(line[5:]))
                    if len(events) == 2:
                        wait_running(server, len(blocking) + 1)
                        stopped.enter_context(server.shard_stopped())
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


def wait_admitted(server: LiveServer, timeout_s: float = 60.0) -> None:
    """Wait until a request holds KV blocks (``shardserve_kv_blocks_used``): admitted,
    its prefill sent to the (stopped) shard."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name == "shardserve_kv_blocks_used" and float(value) >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the request was never admitted")


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_a_request_running_at_sigterm_gets_the_whole_graceful_timeout(
    tiny_model_dir: Path, tmp_path: Path, api_servers: str
) -> None:
    """A request that can only go on half a second before the graceful timeout ends
    (its shard stopped until then) finishes whole (it used to be failed 1 s before the
    timeout ended)."""
    grace_s = 2
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--graceful-timeout", str(grace_s), "--api-server-count", api_servers])
    try:
        answers: list[httpx.Response] = []
        body = {"inputs": "a b", "parameters": {"max_new_tokens": 4, "ignore_eos": True,
                                                "details": True}}
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{server.url}/generate", json=body, timeout=120)))
        with server.shard_stopped():
            client.start()
            wait_admitted(server)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(grace_s - 0.5)
        client.join(timeout=120)
        assert answers[0].status_code == 200, answers[0].text
        details = answers[0].json()["details"]
        assert (details["finish_reason"], details["generated_tokens"]) == ("length", 4)
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_a_grpc_stream_cut_by_the_shutdown_gets_unavailable(
    tiny_model_dir: Path, tmp_path: Path, api_servers: str
) -> None:
    """A gRPC stream still running when the graceful timeout ends (its shard stopped)
    is answered UNAVAILABLE, naming the shutdown (the client may retry elsewhere), not
    INTERNAL."""
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--graceful-timeout", "1", "--api-server-count", api_servers])
    try:
        request = generate_pb2.GenerateRequest(
            inputs="a b", parameters=generate_pb2.Parameters(
                max_new_tokens=LONG["max_new_tokens"], ignore_eos=True))
        errors: list[grpc.RpcError] = []

        def stream() -> None:
            with grpc.insecure_channel(server.grpc_address) as channel:
                stub = generate_pb2_grpc.TextGenerationStub(channel)
                try:
                    for _ in stub.GenerateStream(request, timeout=120):
                        pass
                except grpc.RpcError as error:
                    errors.append(error)

        client = threading.Thread(target=stream)
        with server.shard_stopped():
            client.start()
            wait_admitted(server)
            server.process.send_signal(signal.SIGTERM)
            client.join(timeout=120)
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert "shut down" in str(errors[0].details())
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
