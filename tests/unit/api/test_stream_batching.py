"""A stream writer that fell behind sends the events that arrived meanwhile together:
:meth:`MergedStream.take_ready` hands them over without waiting, in order, and leaves
an error for the iteration."""

from __future__ import annotations

import asyncio

import pytest

from router.api.generation import GenerationFailed, MergedStream
from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer
from tests.unit.api.scripted import ScriptedShardClient

TOKENS = [100, 101, 102, 103, 104, 105]


def _engine(tokenizer: Tokenizer) -> Engine:
    shard = ScriptedShardClient(lambda _prompt: TOKENS)
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                             max_batch_prefill_tokens=256)
    return Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                  shard.block_size)


def _request(n: int = len(TOKENS)) -> GenerationRequest:
    return GenerationRequest((5, 6, 7), SamplingParams(),
                             StoppingParams(max_new_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("requests", [1, 2])
async def test_events_that_arrived_come_together(tokenizer: Tokenizer, requests: int) -> None:
    engine = _engine(tokenizer)
    engine.start()
    try:
        async with MergedStream(engine, [_request()] * requests) as stream:
            events = aiter(stream)
            first = await anext(events)
            await asyncio.sleep(0.2)  # the writer is behind: every token is computed
            ready = stream.take_ready()
            assert stream.take_ready() == []
            rest = [item async for item in events]
        got = [first, *ready, *rest]
        for index in range(requests):
            assert [e.id for i, e in got if i == index] == TOKENS
        # everything after the first event came without waiting
        assert len(ready) == requests * len(TOKENS) - 1 and rest == []
        assert ready[-1][1].finish is not None
    finally:
        await engine.stop()


async def test_an_error_is_left_for_the_iteration(tokenizer: Tokenizer) -> None:
    engine = _engine(tokenizer)
    engine.start()
    try:
        async with MergedStream(engine, [_request(50)]) as stream:
            events = aiter(stream)
            await anext(events)
            await engine.stop()  # the loop stops: no more tokens
            engine.fail_all("the shard group is down")
            ready = stream.take_ready()
            assert all(event.finish is None for _, event in ready)
            with pytest.raises(GenerationFailed, match="the shard group is down"):
                await anext(events)
    finally:
        await engine.stop()
