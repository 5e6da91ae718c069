"""Faults against the real server (tiny model, ``--executor local``): a shard process
stopped with SIGSTOP mid-stream is noticed by the liveness ping (or by the step
deadline), the stream ends with an error, ``/health`` and gRPC health say so in JSON /
NOT_SERVING, and the group is restarted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.conftest import launch, stop
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

RANK_LINE = re.compile(r"shard rank (\d+): pid (\d+) on node")
BODY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


def shard_pid(log_path: Path) -> int:
    """pid of the latest rank 0 process in the launcher's log."""
    return int(RANK_LINE.findall(log_path.read_text())[-1][1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def generate(base_url: str) -> list[int]:
    body = {**BODY, "parameters": {**BODY["parameters"], "details": True}}
    response = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def stream_through(
    base_url: str, fault: Callable[[], None]
) -> tuple[list[dict[str, object]], float]:
    """Stream a long generation, call ``fault`` after 3 tokens; return the events and
    the seconds from the fault to the end of the stream (giving up after 60 s: the
    server's keep-alive pings would hold the stream open as long as it hangs)."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 480,
                                                         "ignore_eos": True}}
    events: list[dict[str, object]] = []
    faulted_at = float("inf")
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 3:
                    fault()
                    faulted_at = time.monotonic()
            if time.monotonic() - faulted_at > 60:
                break
    return events, time.monotonic() - faulted_at


def wait_until_healthy_again(base_url: str, process: subprocess.Popen[bytes]) -> list[int]:
    """Poll /health until 200 (every answer JSON); return the statuses seen."""
    statuses = []
    deadline = time.monotonic() + 240
    while True:
        response = httpx.get(f"{base_url}/health", timeout=30)
        assert response.headers["content-type"] == "application/json", response.text
        statuses.append(response.status_code)
        if response.status_code == 200:
            return statuses
        assert response.json()["error_type"] == "unhealthy"
        assert process.poll() is None, "the server exited instead of restarting"
        assert time.monotonic() < deadline, "the shard group did not come back"
        time.sleep(0.5)


@pytest.fixture
def started(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[str, subprocess.Popen[bytes], Path]]]:
    """``started(*flags)`` launches the tiny model; stops it and any stopped shard after."""
    launched: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(*flags: str) -> tuple[str, subprocess.Popen[bytes], Path]:
        log_path = tmp_path / f"server{len(launched)}.log"
        base_url, process = launch(
            ["--model", str(tiny_model_dir), "--executor", "local", "--max-restarts", "2",
             "--max-total-tokens", "512", *flags], log_path)
        launched.append((process, log_path))
        return base_url, process, log_path

    yield start
    for process, log_path in launched:
        pids = [int(pid) for _, pid in RANK_LINE.findall(log_path.read_text())]
        stop(process)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stopped_shard_ends_streams_then_the_group_restarts(
    started: Callable[..., tuple[str, subprocess.Popen[bytes], Path]],
) -> None:
    grpc_port = unused_port()
    base_url, process, log_path = started("--grpc-port", str(grpc_port))
    before = generate(base_url)
    victim = shard_pid(log_path)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    request = health_pb2.HealthCheckRequest()
    assert health.Check(request, timeout=30).status == health_pb2.HealthCheckResponse.SERVING

    events, ended_after = stream_through(base_url, lambda: os.kill(victim, signal.SIGSTOP))
    # The liveness ping (5 s) notices it: not the step deadline (at least 30 s here).
    assert "stopped answering" in str(events[-1].get("error")), events[-1]
    assert ended_after < 25, f"the stream ended {ended_after:.1f} s after SIGSTOP"
    assert health.Check(request, timeout=30).status == (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )
    assert 503 in wait_until_healthy_again(base_url, process)
    assert not alive(victim)  # killed by the restart
    assert shard_pid(log_path) != victim
    assert health.Check(request, timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    assert generate(base_url) == before


def test_step_past_step_timeout_restarts_the_group(
    started: Callable[..., tuple[str, subprocess.Popen[bytes], Path]],
) -> None:
    base_url, process, log_path = started("--step-timeout", "2")
    before = generate(base_url)
    victim = shard_pid(log_path)
    events, ended_after = stream_through(base_url, lambda: os.kill(victim, signal.SIGSTOP))
    # The 2 s step deadline fires before the 5 s liveness ping.
    # the client reads plain words; the gRPC detail goes to the server log
    error = str(events[-1].get("error"))
    assert "did not answer in time" in error, events[-1]
    assert "DEADLINE_EXCEEDED" in log_path.read_text()
    assert ended_after < 25, f"the stream ended {ended_after:.1f} s after SIGSTOP"
    assert 503 in wait_until_healthy_again(base_url, process)
    assert shard_pid(log_path) != victim
    assert generate(base_url) == before


def test_requests_arriving_after_a_killed_shard_wait_for_the_new_group(
    started: Callable[..., tuple[str, subprocess.Popen[bytes], Path]],
) -> None:
    import concurrent.futures

    base_url, process, log_path = started()
    before = generate(base_url)
    victim = shard_pid(log_path)
    events, _ = stream_through(base_url, lambda: os.kill(victim, signal.SIGKILL))
    assert "error" in events[-1], events[-1]  # the running stream fails with its rank
    # Sent at once after the failure, before the launcher has seen the dead rank (it
    # polls every 0.5 s): they wait in the queue for the restarted group.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = []
        for _ in range(6):
            futures.append(pool.submit(generate, base_url))
            time.sleep(0.05)
        assert [f.result() for f in futures] == [before] * 6
    assert shard_pid(log_path) != victim and process.poll() is None
