"""``--api-server-count``: API processes beside the engine process, each serving HTTP and
the public gRPC API over a socket to the engine.

Real server (``shardserve launch`` on the tiny model, local executor), real clients
(httpx, the ``openai`` package, a gRPC stub), real signals.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from router.pb import generate_pb2, generate_pb2_grpc
from tests.integration.live_server import LiveServer, launch_tiny

_API_PID = re.compile(r"API process (\d+) \(pid (\d+)\) serving")


def api_pids(server: LiveServer, count: int = 2) -> dict[int, int]:
    """``{index: pid}`` of the API processes, from the launcher's log, once all ``count``
    are there (the first to start may answer /health before the others have)."""
    deadline = time.monotonic() + 60
    while True:
        pids = {int(index): int(pid) for index, pid in _API_PID.findall(server.log())}
        if len(pids) >= count or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("api-processes") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--api-server-count", "2"])
    yield live
    live.stop()


def test_two_api_processes_serve_one_engine(server: LiveServer) -> None:
    assert sorted(api_pids(server)) == [0, 1]
    body = {"inputs": "The cat sat", "parameters": {"max_new_tokens": 8}}

    def post(_: int) -> httpx.Response:
        # a connection each: the kernel spreads them over both processes
        return httpx.post(f"{server.url}/generate", json=body, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(post, range(32)))
    assert all(answer.status_code == 200 for answer in answers), answers[0].text
    texts = {answer.json()["generated_text"] for answer in answers}
    assert len(texts) == 1 and texts != {""}  # greedy: the same answer every time

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=client.models.list().data[0].id,
                                            prompt="The cat sat", max_tokens=6,
                                            temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].text for chunk in chunks)

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            inputs="Hi", parameters=generate_pb2.Parameters(max_new_tokens=3, ignore_eos=True))
        assert stub.Generate(request, timeout=60).sequence.generated_tokens == 3

    # refused in an API process, counted by the engine; the engine's counts on /metrics
    assert httpx.post(f"{server.url}/generate", json={"inputs": ""}, timeout=30
                      ).status_code == 422
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'shardserve_requests_total{outcome="success"} 34.0' in metrics
    assert 'shardserve_requests_total{outcome="rejected"} 1.0' in metrics
    info = httpx.get(f"{server.url}/info", timeout=30).json()
    assert info["kv_blocks_used"] == 0 and info["kv_blocks_total"] > 0


def test_an_api_process_that_dies_stops_the_server(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log", ["--api-server-count", "2"])
    try:
        pids = api_pids(server)
        os.kill(pids[0], signal.SIGKILL)
        # the server exits with an error (a supervisor such as Kubernetes restarts it),
        # its other API process and its shard with it
        assert server.process.wait(timeout=90) == 1
        assert f"API process (pid {pids[0]}) exited with code -9" in server.log()
        deadline = time.monotonic() + 10
        while alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pids[1])
        assert all(not alive(pid) for pid in server.shard_pids().values())
    finally:
        server.stop()


def test_sigterm_drains_every_api_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--api-server-count", "2", "--graceful-timeout", "60"])
    try:
        pids = api_pids(server)
        body = {"inputs": "a b", "parameters": {"max_new_tokens": 120, "ignore_eos": True}}
        tokens = 0
        refused = False
        with httpx.stream("POST", f"{server.url}/generate_stream", json=body,
                          timeout=120) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                tokens += 1
                if tokens == 2:
                    server.process.send_signal(signal.SIGTERM)
                    time.sleep(0.5)
                    # admission stopped: the listening socket is closed in every process
                    try:
                        httpx.post(f"{server.url}/generate", json=body, timeout=5)
                    except httpx.ConnectError:
                        refused = True
        assert refused
        assert tokens == 120  # the open stream ran to its end
        assert server.process.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in pids.values())
    finally:
        server.stop()


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_ctrl_c_drains_like_sigterm(tiny_model_dir: Path, tmp_path: Path,
                                    api_servers: str) -> None:
    """SIGINT to the whole process group, as Ctrl-C on a terminal sends it: the shards
    and the API processes leave the decision to the launcher, which drains."""
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--api-server-count", api_servers])
    try:
        body = {"inputs": "a b", "parameters": {"max_new_tokens": 60, "ignore_eos": True}}
        tokens = 0
        with httpx.stream("POST", f"{server.url}/generate_stream", json=body,
                          timeout=120) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                assert "error" not in line, line
                tokens += 1
                if tokens == 2:
                    os.killpg(server.process.pid, signal.SIGINT)
        assert tokens == 60
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def _owner_of_connection(pids: list[int], server_port: int, client_port: int) -> int:
    """Which of ``pids`` holds the server side of the TCP connection between
    ``server_port`` and ``client_port`` (read from /proc: the socket's inode)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (int(local.split(":")[1], 16) == server_port
                and int(remote.split(":")[1], 16) == client_port):
            inode = fields[9]
    assert inode is not None, "connection not found"
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError("no API process holds the connection")


def test_when_an_api_process_dies_the_others_streams_end_with_a_reason(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--api-server-count", "2", "--graceful-timeout", "2"])
    try:
        pids = list(api_pids(server).values())
        body = {"inputs": "a b", "parameters": {"max_new_tokens": 480, "ignore_eos": True}}
        last = ""
        with contextlib.ExitStack() as stopped, httpx.stream(
                "POST", f"{server.url}/generate_stream", json=body, timeout=120) as stream:
            client_port = stream.extensions["network_stream"].get_extra_info("client_addr")[1]
            port = int(server.url.rsplit(":", 1)[1])
            serving = _owner_of_connection(pids, port, client_port)
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    if not last:  # the first token: kill the other process
                        # (the shard stopped: the stream cannot finish before the drain ends)
                        stopped.enter_context(server.shard_stopped())
                        os.kill(next(pid for pid in pids if pid != serving), signal.SIGKILL)
                    last = line
        # the stream on the surviving process ends with an error event saying why
        # (the drain a SIGTERM starts), not with a cut connection
        assert "shut down" in last, last
        assert server.process.wait(timeout=60) == 1
        assert "Exception in ASGI application" not in server.log()
    finally:
        server.stop()


def _listening(reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:  # as another server's gRPC port is bound
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("api_servers", ["0", "1"])
@pytest.mark.parametrize(("api", "flag"), [("HTTP", "--port"), ("gRPC", "--grpc-port")])
def test_ports_in_use_end_the_launch_before_any_shard_starts(
    tiny_model_dir: Path, tmp_path: Path, api_servers: str, api: str, flag: str
) -> None:
    """An HTTP or gRPC port in use is one start-up error line naming the flag and the
    address, before any shard starts (no model load, no warm-up, no line of gRPC's
    core), with the APIs in the engine's process or beside it. A gRPC port another
    server holds with SO_REUSEPORT is not silently shared either."""
    with _listening(reuse_port=api == "gRPC") as taken:
        port = taken.getsockname()[1]
        server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                             ["--api-server-count", api_servers, flag, str(port)], wait=False)
        assert server.process.wait(timeout=120) == 1
        lines = server.log().splitlines()
        assert len(lines) == 1, lines  # no shard, no warm-up, no gRPC core line
        assert lines[0].endswith(
            f"start-up failed: cannot bind the {api} port 127.0.0.1:{port}: Address already "
            f"in use (--host, {flag})"), lines
