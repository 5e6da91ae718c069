"""Health against a real shard process that is stopped (SIGSTOP), resumed and killed:
the gRPC health service answers what ``GET /health`` answers, and ``/health`` answers
JSON even when the shard group's channels close under it (as a restart does)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.api.app import create_app
from router.api.state import ServerState
from router.config import SchedulerConfig, ValidationLimits
from router.engine import Engine
from router.grpc_api.server import SERVICE_NAME, start_grpc_server
from router.shard_client import ShardClient
from router.tokenizer import Tokenizer
from router.validation import Validator
from tests.ports import unused_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def shard_process(tiny_model_dir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``python -m shard.server`` process serving the tiny model: (address, process)."""
    port = unused_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "shard.server", "--model", str(tiny_model_dir), "--port",
         str(port), "--device", "cpu", "--kv-cache-bytes", str(4 * 1024 * 1024)],
    )
    try:
        yield f"127.0.0.1:{port}", process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
async def state(
    shard_process: tuple[str, subprocess.Popen[bytes]], tiny_model_dir: Path
) -> AsyncIterator[ServerState]:
    """Server state over a real client of the shard process (engine not started)."""
    client = ShardClient([shard_process[0]])
    await client.wait_ready(60)
    config = SchedulerConfig(max_batch_prefill_tokens=64, max_input_tokens=32,
                             max_total_tokens=128)
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    engine = Engine(client, tokenizer, config, num_blocks=16, block_size=16)
    validator = Validator(tokenizer, engine.scheduler, ValidationLimits())
    yield ServerState(engine=engine, validator=validator, model_id="tiny", dtype="float32",
                      device_type="cpu", num_shard=1, attention_backend="torch",
                      version="test")
    await client.close()


@pytest.fixture
async def http_url(state: ServerState) -> AsyncIterator[str]:
    """The HTTP app served by uvicorn on a free port."""
    port = unused_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


async def test_health_is_json_when_the_shard_channels_close_under_it(
    state: ServerState, http_url: str, shard_process: tuple[str, subprocess.Popen[bytes]]
) -> None:
    os.kill(shard_process[1].pid, signal.SIGSTOP)  # the Health call hangs ...
    async with httpx.AsyncClient(timeout=30) as http:
        pending = asyncio.create_task(http.get(f"{http_url}/health"))
        await asyncio.sleep(1.0)
        await state.engine.close_shards()  # ... until a restart closes the channels
        response = await pending
        assert response.status_code == 503
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error_type"] == "unhealthy"
        # Closed for good: still JSON.
        again = await http.get(f"{http_url}/health")
        assert again.status_code == 503 and again.json()["error_type"] == "unhealthy"


async def next_status(watch: AsyncIterator[health_pb2.HealthCheckResponse]) -> int:
    """The next status a Watch stream sends (within 30 s)."""
    return int((await asyncio.wait_for(anext(watch), timeout=30)).status)


async def grpc_status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
    return int(response.status)


async def test_grpc_health_follows_http_health(
    state: ServerState, shard_process: tuple[str, subprocess.Popen[bytes]]
) -> None:
    server, port = await start_grpc_server(state, "127.0.0.1", 0)
    pid = shard_process[1].pid
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert await grpc_status(stub) == SERVING
            assert await grpc_status(stub, SERVICE_NAME) == SERVING
            call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            watch = aiter(call)
            assert await next_status(watch) == SERVING

            os.kill(pid, signal.SIGSTOP)  # a hung shard
            assert await next_status(watch) == NOT_SERVING
            assert await grpc_status(stub) == NOT_SERVING
            os.kill(pid, signal.SIGCONT)
            assert await grpc_status(stub, SERVICE_NAME) == SERVING
            assert await next_status(watch) == SERVING

            state.engine.drain()  # SIGTERM
            assert await grpc_status(stub) == NOT_SERVING
            state.engine._draining = False  # undone, for the checks below
            assert await grpc_status(stub) == SERVING

            shard_process[1].kill()  # a dead shard
            shard_process[1].wait()
            assert await grpc_status(stub, SERVICE_NAME) == NOT_SERVING
            call.cancel()
    finally:
        if shard_process[1].poll() is None:
            os.kill(pid, signal.SIGCONT)
        await server.stop(grace=None)
