"""``/health`` answers from what the supervisor saw, never by calling a shard: a flood of
probes sends no shard RPC, a rank that stops answering is reported at once (not after a
ping's timeout), the group's restart and its end too, each change logged once however
many probes read it. Over the engine in its process and through an API process's proxy
(``make_app`` runs each test both ways).

The supervisor watches a scripted executor whose liveness check the test holds and
releases (a shard stopped with SIGSTOP, as the executor sees it)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from loguru import logger

import router.launcher
from router.config import ServerConfig
from router.engine.loop import Engine
from router.executors import StartupError
from router.health import GroupState
from router.launcher import Supervisor, WarmupBudgets
from router.tokenizer import Tokenizer
from shard.config import ShardConfig
from tests.unit.api.conftest import AppFactory, text_script

NOT_ANSWERING = re.compile(r"model shard 0 is not answering \(for \d+\.\d s\)")
RESTARTING = "the shard group is restarting (shard rank 0 died or stopped answering)"
DOWN = "the shard group is down (shard rank 0 died or stopped answering; no restart left)"
FLOOD = 200


class ScriptedExecutor:
    """A shard group whose liveness check waits while :attr:`answering` is clear and
    then reports :attr:`dead`; its restart waits for :attr:`may_stop`, then fails."""

    def __init__(self) -> None:
        self.answering = asyncio.Event()
        self.answering.set()
        self.dead: int | None = None
        self.may_stop = asyncio.Event()
        self.checks = 0

    async def start(self) -> list[str]:
        raise StartupError("no shard group in this test")

    async def dead_rank(self) -> int | None:
        await self.answering.wait()
        self.checks += 1
        return self.dead

    def mark_ready(self) -> None:
        """Nothing to mark."""

    async def stop_group(self, grace_s: float = 15.0) -> None:
        await self.may_stop.wait()

    async def stop(self) -> None:
        """Nothing to stop."""

    @property
    def exit_at_once(self) -> bool:
        return False


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The messages of the warnings logged during the test."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]),
                      level="WARNING")
    yield lines
    logger.remove(sink)


@pytest.fixture
def fast_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness checks every 10 ms; a check waiting 50 ms counts as not answering."""
    monkeypatch.setattr(router.launcher, "LIVENESS_POLL_S", 0.01)
    monkeypatch.setattr(router.launcher, "NOT_ANSWERING_AFTER_S", 0.05)


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (failing after 30 s)."""
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
async def supervised(
    make_app: AppFactory, tokenizer: Tokenizer, fast_checks: None
) -> AsyncIterator[tuple[httpx.AsyncClient, Engine, ScriptedExecutor, list[int]]]:
    """(HTTP client, engine, executor, shard Health calls so far) with a supervisor
    running over the scripted executor (one restart allowed)."""
    client, shard, engine = await make_app(text_script(tokenizer, " fine"))
    health_calls = [0]

    async def counted_health() -> None:
        health_calls[0] += 1

    shard.health = counted_health  # type: ignore[method-assign]
    shard.hung_rank = None  # type: ignore[attr-defined]  # no step ran past its deadline
    executor = ScriptedExecutor()
    config = ServerConfig(shard=ShardConfig(model_path="m", model_id="m"), executor="local",
                          max_restarts=1)
    supervisor = Supervisor(executor, engine, config,  # type: ignore[arg-type]
                            WarmupBudgets(256, 256, 8), on_give_up=lambda: None)
    running = asyncio.ensure_future(supervisor.run())
    yield client, engine, executor, health_calls
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


async def flood(client: httpx.AsyncClient) -> list[httpx.Response]:
    """``FLOOD`` concurrent ``GET /health``."""
    return list(await asyncio.gather(*(client.get("/health") for _ in range(FLOOD))))


async def test_a_flood_of_probes_calls_no_shard(
    supervised: tuple[httpx.AsyncClient, Engine, ScriptedExecutor, list[int]],
) -> None:
    client, _, executor, health_calls = supervised
    await until(lambda: executor.checks >= 2)
    answers = await flood(client)
    assert [answer.status_code for answer in answers] == [200] * FLOOD
    assert health_calls[0] == 0


async def test_each_state_is_answered_at_once_and_logged_once(
    supervised: tuple[httpx.AsyncClient, Engine, ScriptedExecutor, list[int]],
    warnings: list[str],
) -> None:
    client, engine, executor, health_calls = supervised
    await until(lambda: executor.checks >= 1)
    assert (await client.get("/health")).status_code == 200

    executor.answering.clear()  # the rank stops answering: the check waits
    await until(lambda: engine.shard_health.state is GroupState.NOT_ANSWERING)
    answers = await flood(client)
    assert {answer.status_code for answer in answers} == {503}
    for answer in answers:
        assert answer.json()["error_type"] == "unhealthy"
        assert NOT_ANSWERING.fullmatch(answer.json()["error"]), answer.json()

    executor.dead = 0  # the check ends: the rank is dead; the restart waits
    executor.answering.set()
    await until(lambda: engine.shard_health.state is GroupState.RESTARTING)
    answers = await flood(client)
    assert {answer.json()["error"] for answer in answers} == {RESTARTING}

    executor.may_stop.set()  # the restart fails: no restart left
    await until(lambda: engine.shard_health.state is GroupState.DOWN)
    answers = await flood(client)
    assert {answer.json()["error"] for answer in answers} == {DOWN}
    assert {answer.status_code for answer in answers} == {503}

    assert health_calls[0] == 0
    health_lines = [line for line in warnings if line.startswith("health: ")]
    assert len(health_lines) == 3, health_lines  # one per change, not one per probe
    assert NOT_ANSWERING.search(health_lines[0])
    assert RESTARTING in health_lines[1] and DOWN in health_lines[2]


async def test_a_rank_that_answers_again_is_live_again(
    supervised: tuple[httpx.AsyncClient, Engine, ScriptedExecutor, list[int]],
) -> None:
    client, engine, executor, _ = supervised
    executor.answering.clear()
    await until(lambda: engine.shard_health.state is GroupState.NOT_ANSWERING)
    assert (await client.get("/health")).status_code == 503
    executor.answering.set()  # a slow answer, not a dead rank
    await until(lambda: engine.shard_health.state is GroupState.LIVE)
    assert (await client.get("/health")).status_code == 200
