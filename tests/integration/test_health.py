"""Health of a real server whose shard process is stopped (SIGSTOP): ``GET /health`` and
the gRPC health service answer at once from what the supervisor saw (the shard not
answering, then the group restarting, then serving again), never waiting on the stopped
shard; many probes log one line per change of state."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.grpc_api.server import SERVICE_NAME
from tests.integration.live_server import LiveServer, launch_tiny

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NOT_ANSWERING = re.compile(r"model shard 0 is not answering \(for \d+\.\d s\)")
RESTARTING = "the shard group is restarting (shard rank 0 died or stopped answering)"
# A probe sending a shard RPC would wait for the RPC's 5 s deadline while the shard is
# stopped; one answered from the known state answers long before that.
PROBE_TIMEOUT_S = 4.0


@pytest.fixture(params=[0, 1], ids=["in_process", "api_process"])
def server(request: pytest.FixtureRequest, tiny_model_dir: Path,
           tmp_path: Path) -> Iterator[LiveServer]:
    """The tiny model served with the APIs in the engine's process, or in one API
    process (which asks the engine process over its socket)."""
    live = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                       ["--api-server-count", str(request.param), "--max-restarts", "1"])
    yield live
    for pid in live.shard_pids().values():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    live.stop()


async def problems(http: httpx.AsyncClient, url: str, count: int) -> list[str]:
    """The answers of ``count`` concurrent ``GET /health``: each a 503 in JSON."""
    answers = await asyncio.gather(*(http.get(f"{url}/health") for _ in range(count)))
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error_type"] == "unhealthy"
    return [answer.json()["error"] for answer in answers]


async def check(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return int((await stub.Check(request, timeout=PROBE_TIMEOUT_S)).status)


async def test_a_stopped_shard_is_reported_at_once_until_the_group_is_back(
    server: LiveServer,
) -> None:
    async with (httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as http,
                grpc.aio.insecure_channel(server.grpc_address) as channel):
        stub = health_pb2_grpc.HealthStub(channel)
        assert await check(stub) == SERVING
        watch = aiter(stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)))
        assert (await anext(watch)).status == SERVING

        os.kill(server.shard_pids()[0], signal.SIGSTOP)
        seen: list[str] = []
        while (answer := await http.get(f"{server.url}/health")).status_code == 200:
            await asyncio.sleep(0.05)
        seen.append(answer.json()["error"])
        # a flood of probes while the shard is stopped: each answered, none waits on it
        seen += await problems(http, server.url, 50)
        assert await check(stub) == NOT_SERVING
        assert await check(stub, SERVICE_NAME) == NOT_SERVING
        assert (await asyncio.wait_for(anext(watch), 30)).status == NOT_SERVING
        while (answer := await http.get(f"{server.url}/health")).status_code != 200:
            seen.append(answer.json()["error"])
            await asyncio.sleep(0.05)
        assert await check(stub) == SERVING

    assert NOT_ANSWERING.fullmatch(seen[0]), seen[0]  # found by the liveness ping
    assert RESTARTING in seen
    assert all(NOT_ANSWERING.fullmatch(problem) or problem == RESTARTING for problem in seen)
    log = server.log()
    # one line per change of state, not one per probe
    assert len(re.findall(r"health: model shard 0 is not answering", log)) == 1, log
    assert log.count(f"health: {RESTARTING}") == 1
    assert log.count("health: the shard group answers again") == 1
    assert "health check failed" not in log
