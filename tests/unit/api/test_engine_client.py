"""The engine seen from an API process (``--api-server-count``): :class:`EngineClient` over a
socket to :class:`ApiConnection` gives what the engine gives in its own process."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from router.api.generation import GenerationFailed, MergedStream, run_all
from router.config import SchedulerConfig
from router.engine.api import EngineApi, QueueFullError, ShuttingDownError
from router.engine.client import ENGINE_GONE, EngineClient
from router.engine.loop import Engine
from router.engine.server import ApiConnection
from router.request import (
    Event,
    GenerationRequest,
    HeldAnswer,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from router.tokenizer import Tokenizer
from tests.unit.api.conftest import engine_client_of
from tests.unit.api.scripted import ScriptedShardClient

BUDGETS = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                          max_batch_prefill_tokens=256)


@pytest.fixture
async def pair(tokenizer: Tokenizer) -> AsyncIterator[tuple[Engine, EngineClient, list[Any]]]:
    """A started engine over a scripted group, its proxy, and the two serving tasks."""
    said = tokenizer.encode(" one two three, stop here and four", add_special_tokens=False)
    shard = ScriptedShardClient(lambda prompt: [*said, prompt[-1]])
    engine = Engine(shard, tokenizer, BUDGETS, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    client, tasks = await engine_client_of(engine)
    yield engine, client, tasks
    await engine.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _requests() -> list[GenerationRequest]:
    sampling = SamplingParams()
    return [
        GenerationRequest((5, 6, 7), sampling, StoppingParams(max_new_tokens=12,
                                                              ignore_eos=True),
                          top_n_tokens=2, prompt_logprobs=True),
        GenerationRequest((8, 9), sampling, StoppingParams(max_new_tokens=30,
                                                           stop_sequences=(" stop",))),
        GenerationRequest((10,), sampling, StoppingParams(max_new_tokens=5), stream=False,
                          token_texts=False),
    ]


async def _events(engine: EngineApi, request: GenerationRequest) -> list[TokenEvent]:
    events = []
    async with asyncio.timeout(30.0):
        async for event in engine.generate(request):
            assert isinstance(event, TokenEvent), event
            events.append(event)
    return events


async def test_the_events_equal_those_of_the_engine_in_its_process(
    pair: tuple[Engine, EngineClient, list[Any]],
) -> None:
    engine, client, _ = pair
    for request in _requests():
        local, remote = await asyncio.gather(_events(engine, request), _events(client, request))
        assert remote == local and remote[-1].finish is not None
    # together, as several API requests at once
    remote_all, local_all = await asyncio.wait_for(asyncio.gather(
        run_all(client, _requests()), run_all(engine, _requests())), 30.0)
    assert [done.tokens for done in remote_all] == [done.tokens for done in local_all]
    assert all(done.finish is not None for done in remote_all)


async def test_one_message_carries_every_event_of_an_engine_step(
    pair: tuple[Engine, EngineClient, list[Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, client, _ = pair
    batches: list[list[Any]] = []
    send = ApiConnection._send

    def recording(self: ApiConnection, message: tuple[Any, ...]) -> None:
        if message[0] == "events":
            batches.append(message[1])
        send(self, message)

    monkeypatch.setattr(ApiConnection, "_send", recording)
    stopping = StoppingParams(max_new_tokens=20, ignore_eos=True)
    requests = [GenerationRequest((5, i), SamplingParams(), stopping) for i in range(16)]

    async def stream(request: GenerationRequest) -> int:
        return len(await _events(client, request))

    assert await asyncio.gather(*map(stream, requests)) == [20] * 16
    # 16 × 20 token events in about one message per step (20 steps), not one per event
    assert sum(map(len, batches)) == 16 * 20 and len(batches) <= 24

    # whole answers: one item each, the engine's held events as they are
    batches.clear()
    answers = await asyncio.wait_for(run_all(client, requests), 30.0)
    assert [len(done.tokens) for done in answers] == [20] * 16
    items = [item for batch in batches for item in batch]
    assert len(items) == 16 and all(isinstance(item[1], HeldAnswer) for item in items)
    assert all(len(item[1]) == 20 for item in items)
    # one request's answer reaches its reader as it crossed, its events not yet built
    [done] = await asyncio.wait_for(run_all(client, requests[:1]), 30.0)
    assert done.answer is not None and done.events == [] and done.num_generated == 20


async def test_a_client_that_leaves_frees_its_blocks(
    pair: tuple[Engine, EngineClient, list[Any]],
) -> None:
    engine, client, _ = pair
    total = engine.block_manager.num_free
    request = GenerationRequest((5, 6, 7), SamplingParams(),
                                StoppingParams(max_new_tokens=200, ignore_eos=True))
    stream = client.generate(request)
    await anext(stream)
    assert engine.block_manager.num_free < total and engine.status().running == 1
    await stream.aclose()  # the client left
    async with asyncio.timeout(10.0):
        while engine.status().running or engine.block_manager.num_free != total:
            await asyncio.sleep(0.01)
    # cancelled there, not run to its end
    registry = engine.metrics.registry
    assert registry.get_sample_value("shardserve_requests_total", {"outcome": "cancelled"}) == 1


async def _one_place_taken(
    engine: Engine, api: EngineApi
) -> tuple[AsyncGenerator[Event, None], GenerationRequest]:
    """Allow one request at a time and start a long one through ``api``: (its events,
    once the first has come; the request)."""
    engine.scheduler.config = dataclasses.replace(BUDGETS, max_concurrent_requests=1)
    long = GenerationRequest((5,), SamplingParams(),
                             StoppingParams(max_new_tokens=200, ignore_eos=True))
    running = api.generate(long)
    await anext(running)
    return running, long


async def test_refusals_raise_as_they_do_in_the_engine_process(
    pair: tuple[Engine, EngineClient, list[Any]],
) -> None:
    engine, client, _ = pair
    running, long = await _one_place_taken(engine, client)
    with pytest.raises(QueueFullError, match="max_concurrent_requests=1"):
        async with MergedStream(client, [long]) as stream:
            await anext(aiter(stream))
    await running.aclose()
    engine.drain()
    with pytest.raises(ShuttingDownError):
        async with MergedStream(client, [long]) as stream:
            await anext(aiter(stream))
    assert await client.health_problem() == "shutting down"


async def test_budgets_follow_a_restarted_group(
    pair: tuple[Engine, EngineClient, list[Any]], tokenizer: Tokenizer,
) -> None:
    engine, client, _ = pair
    await engine.stop()
    engine.block_manager.hit_tokens = 1234  # served from the prefix cache before the restart
    smaller = dataclasses.replace(BUDGETS, max_total_tokens=128, max_input_tokens=100)
    engine.replace_shards(ScriptedShardClient(lambda _p: [100]), smaller,  # type: ignore[arg-type]
                          num_blocks=32, block_size=16)
    engine.start()
    async with asyncio.timeout(10.0):
        while client.config != smaller:
            await asyncio.sleep(0.01)
    assert client.budgets.block_manager.num_blocks == 32
    after = await client.snapshot()
    assert after.kv_blocks_total == 32
    assert after.prefix_cache_hit_tokens == 1234  # a counter never goes back


async def test_when_the_engine_process_goes_its_streams_fail(
    pair: tuple[Engine, EngineClient, list[Any]],
) -> None:
    _, client, tasks = pair
    request = GenerationRequest((5, 6, 7), SamplingParams(),
                                StoppingParams(max_new_tokens=200, ignore_eos=True))
    stream = MergedStream(client, [request])
    events = aiter(stream)
    await anext(events)
    tasks[0].cancel()  # the engine's end of the socket closes
    with pytest.raises(GenerationFailed, match=ENGINE_GONE):
        async with asyncio.timeout(10.0):
            while True:
                await anext(events)
    assert client.gone and await client.health_problem() == ENGINE_GONE
    with pytest.raises(GenerationFailed, match=ENGINE_GONE):  # and so do later ones
        async with MergedStream(client, [request]) as later:
            await anext(aiter(later))


async def test_a_cancelled_request_no_longer_holds_its_place(
    pair: tuple[Engine, EngineClient, list[Any]],
) -> None:
    """A running request cancelled (its client left, or a sibling was refused) leaves the
    batch at the next step; until then it no longer counts against
    max_concurrent_requests, so a request arriving meanwhile is not refused."""
    engine, _, _ = pair
    running, long = await _one_place_taken(engine, engine)
    (seq,) = [*engine.scheduler.running, *engine.scheduler.prefilling]
    engine.cancel(seq)  # no step runs before the submissions below
    assert engine.scheduler.num_requests == 1
    newcomer = engine.submit(long)
    with pytest.raises(QueueFullError, match="max_concurrent_requests=1"):
        engine.submit(long)
    async with asyncio.timeout(10.0):
        while seq in engine.scheduler.running or seq in engine.scheduler.prefilling:
            await asyncio.sleep(0.01)
    engine.cancel(newcomer)
    await running.aclose()
