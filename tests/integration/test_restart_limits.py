"""A shard group restarted with a smaller KV cache: the token budgets derived from its
Warmup replace the old ones for the validator and the scheduler alike, so a request that
fits only the old cache is refused (naming the field) instead of admitted to wait at the
head of the queue for blocks that no longer exist.

The router side is real (executor protocol, start-up, gRPC shard client, supervisor,
engine, validator, HTTP app); the shard group is a gRPC server whose Warmup reports the
block counts the test chooses and whose tokens come from a script.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest

from router.api.app import create_app
from router.config import ServerConfig
from router.launcher import Supervisor, build_state, start_group
from shard.config import ShardConfig
from shard.pb import shard_pb2 as pb
from shard.pb import shard_pb2_grpc
from tests.unit.api.scripted import ScriptedShardClient

T = TypeVar("T")
BLOCK_SIZE = 16
CONTEXT = 512  # max_position_embeddings the shards report


class ScriptedShardService(shard_pb2_grpc.ShardServiceServicer):
    """ShardService whose Warmup reports ``num_blocks``; steps answer from a script, in
    the order of their ``step`` numbers (as a shard runs them)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.steps = ScriptedShardClient(lambda _prompt: [42], num_blocks, BLOCK_SIZE)
        self.next_step = 1
        self.turn = asyncio.Condition()

    async def _in_order(self, step: int, restart: bool,
                        call: Callable[[], Awaitable[T]]) -> T:
        async with self.turn:
            if restart:  # the steps before it are abandoned
                self.next_step = step
                self.turn.notify_all()
            await self.turn.wait_for(lambda: step in (0, self.next_step))
            if restart:
                self.steps.restart_steps()  # held requests are dropped before it runs
            try:
                return await call()
            finally:
                self.next_step += bool(step)
                self.turn.notify_all()

    async def Info(self, request: pb.InfoRequest, context: object) -> pb.InfoResponse:
        return pb.InfoResponse(model_id="scripted", dtype="float32", device="cpu",
                               world_size=1, block_size=BLOCK_SIZE, attention_backend="torch",
                               max_position_embeddings=CONTEXT, vocab_size=49152)

    async def Health(self, request: pb.HealthRequest, context: object) -> pb.HealthResponse:
        return pb.HealthResponse()

    async def Warmup(self, request: pb.WarmupRequest, context: object) -> pb.WarmupResponse:
        self.next_step = 1
        return pb.WarmupResponse(num_blocks=self.num_blocks, block_size=BLOCK_SIZE)

    async def Prefill(self, request: pb.PrefillRequest, context: object) -> pb.PrefillResponse:
        return await self._in_order(request.step, request.restart,
                                    lambda: self.steps.prefill(request))

    async def Decode(self, request: pb.DecodeRequest, context: object) -> pb.DecodeResponse:
        def decode() -> Awaitable[pb.DecodeResponse]:
            # the rows that step: held ones that do not leave (none after a restart)
            leaving = set(request.finished_request_ids)
            rows = [] if self.steps.restart else [
                rid for rid in self.steps.rows if rid not in leaving]
            return self.steps.decode(request, len(rows))

        return await self._in_order(request.step, request.restart, decode)


class ShrinkingExecutor:
    """One-rank groups, each start serving the next of ``block_counts`` KV blocks;
    :meth:`kill` makes the running rank count as dead until the next start."""

    def __init__(self, block_counts: list[int]) -> None:
        self.block_counts = block_counts
        self.starts = 0
        self.dead = False
        self.server: grpc.aio.Server | None = None

    async def start(self) -> list[str]:
        self.server = grpc.aio.server()
        shard_pb2_grpc.add_ShardServiceServicer_to_server(
            ScriptedShardService(self.block_counts[self.starts]), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.starts += 1
        self.dead = False
        return [f"127.0.0.1:{port}"]

    async def dead_rank(self) -> int | None:
        return 0 if self.dead else None

    def mark_ready(self) -> None:
        """Nothing to judge: the test says when the rank dies."""

    def kill(self) -> None:
        self.dead = True

    async def stop_group(self, grace_s: float = 15.0) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    async def stop(self) -> None:
        await self.stop_group()


@pytest.fixture
async def served(default_model_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Supervisor]]:
    """The HTTP app over a group of 64 KV blocks that restarts with 8: (client, supervisor)."""
    executor = ShrinkingExecutor([64, 8])
    config = ServerConfig(shard=ShardConfig(model_path=str(default_model_dir),
                                                  model_id="scripted"),
                          executor="local", max_restarts=1)
    client = await start_group(executor, 30)
    state, warmup = await build_state(config, client)
    state.engine.start()
    supervisor = Supervisor(executor, state.engine, config, warmup, on_give_up=lambda: None)
    watch = asyncio.ensure_future(supervisor.run())
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=20) as http:
        yield http, supervisor
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    await state.engine.stop()
    await state.engine.shards.client.close()
    await executor.stop()


async def generate(http: httpx.AsyncClient, max_new_tokens: int) -> httpx.Response:
    return await http.post("/generate", json={
        "inputs": "Hello",
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "details": True}})


async def test_restart_with_a_smaller_kv_cache_rebuilds_the_limits(
    served: tuple[httpx.AsyncClient, Supervisor],
) -> None:
    http, supervisor = served
    assert (await http.get("/info")).json()["max_total_tokens"] == CONTEXT  # 1024 KV tokens
    long = await generate(http, 300)  # fits the first group's cache
    assert long.status_code == 200, long.text
    assert long.json()["details"]["generated_tokens"] == 300

    executor = supervisor.executor
    assert isinstance(executor, ShrinkingExecutor)
    executor.kill()
    async with asyncio.timeout(20):
        while executor.starts < 2 or supervisor.engine.shards.client.hung_rank is not None or \
                executor.dead:
            await asyncio.sleep(0.05)
        while not (await http.get("/health")).is_success:
            await asyncio.sleep(0.05)

    # Can never fit 128 KV tokens. (Admitted, it would wait at the head of the queue
    # for ever: the ASGI transport has no timeout of its own.)
    refused = await asyncio.wait_for(generate(http, 300), 20)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error_type"] == "validation"
    assert "max_new_tokens" in refused.json()["error"]
    info = (await http.get("/info")).json()
    assert info["kv_blocks_total"] == 8
    assert info["max_total_tokens"] == 8 * BLOCK_SIZE  # derived again from the new Warmup
    assert supervisor.engine.config.max_total_tokens == 8 * BLOCK_SIZE  # the scheduler's too
    served_after = await generate(http, 20)  # nothing blocks the queue head
    assert served_after.status_code == 200, served_after.text
    assert served_after.json()["details"]["generated_tokens"] == 20
