"""The step contract across a failed step and under load, against a scripted shard
group that keeps its KV cache (:mod:`tests.unit.api.kv_scripted`): a prefix-cache hit
must land on blocks whose K/V were computed, and a block is never written while another
request still reads it."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import (
    ErrorEvent,
    Event,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from router.tokenizer import Tokenizer
from tests.unit.api.kv_scripted import KvScriptedShardClient


def _script(prompt: tuple[int, ...]) -> list[int]:
    """Tokens that depend on the prompt, so that a mix-up shows."""
    return [100 + (sum(prompt) + i) % 50 for i in range(64)]


def _engine(shard: KvScriptedShardClient, tokenizer: Tokenizer, **budgets: Any) -> Engine:
    config = SchedulerConfig(**{"max_input_tokens": 64, "max_total_tokens": 128,
                                "max_batch_prefill_tokens": 256, "steps_in_flight": 2,
                                **budgets})
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    return engine


async def _run(engine: Engine, request: GenerationRequest) -> list[Event]:
    return [event async for event in engine.generate(request)]


def _request(prompt: tuple[int, ...], max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(),
                             StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


async def test_a_prompt_whose_prefill_failed_is_not_served_from_the_prefix_cache(
    tokenizer: Tokenizer,
) -> None:
    # The first Prefill fails on the shards (a rank rejects it, or its forward fails):
    # the blocks the router indexed for its prompt hold nothing. The same prompt sent
    # again must be computed, not read from those blocks.
    shard = KvScriptedShardClient(_script, num_blocks=32, block_size=4, fail_steps={1})
    engine = _engine(shard, tokenizer)
    prompt = tuple(range(10, 30))  # 20 tokens: 4 full blocks are indexed at its prefill
    try:
        failed = await _run(engine, _request(prompt, 4))
        again = await _run(engine, _request(prompt, 4))
    finally:
        await engine.stop()
    assert isinstance(failed[-1], ErrorEvent)
    errors = [e.message for e in again if isinstance(e, ErrorEvent)]
    assert errors == []
    assert shard.prefilled[-1].cache_len == 0
    assert [e.id for e in again if isinstance(e, TokenEvent)] == _script(prompt)[:4]
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(4))
async def test_load_with_preemption_prefix_hits_chunks_and_cancels(
    tokenizer: Tokenizer, seed: int
) -> None:
    # Few blocks (preemption), small chunks, shared prefixes, clients that leave early:
    # every request that runs to its end gets its script's tokens, the shard's KV
    # checks hold at every step, and every block is free at the end.
    rng = random.Random(seed)
    shard = KvScriptedShardClient(_script, num_blocks=24, block_size=4)
    engine = _engine(shard, tokenizer, max_batch_prefill_tokens=12)
    prefixes = [tuple(rng.randrange(5, 90) for _ in range(rng.choice((4, 8, 9))))
                for _ in range(3)]

    async def client(index: int) -> tuple[GenerationRequest, list[Event] | None]:
        await asyncio.sleep(rng.random() * 0.02)
        prompt = rng.choice(prefixes) + tuple(rng.randrange(5, 90)
                                              for _ in range(rng.randrange(0, 12)))
        request = _request(prompt, rng.randrange(1, 24))
        if index % 5 == 4:  # leaves after a few tokens
            stream = engine.generate(request)
            async for _ in stream:
                if rng.random() < 0.3:
                    break
            await stream.aclose()
            return request, None
        return request, await _run(engine, request)

    try:
        results = await asyncio.gather(*(client(i) for i in range(30)))
        for _ in range(100):  # the cancelled requests leave with the next steps
            if not engine.scheduler.num_requests:
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    for request, events in results:
        if events is None:
            continue
        errors = [e.message for e in events if isinstance(e, ErrorEvent)]
        assert errors == []
        wanted = _script(request.input_ids)[: request.stopping.max_new_tokens]
        assert [e.id for e in events if isinstance(e, TokenEvent)] == wanted
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_request_preempted_in_the_step_of_its_prefill(
    tokenizer: Tokenizer, depth: int
) -> None:
    # Three one-block prompts are admitted in one Prefill (5 blocks: one kept free per
    # request admitted before), and with decode_during_prefill they decode in the same
    # iteration: each needs a second block, the last one admitted is preempted for them.
    # Its Prefill still goes out as it was scheduled (its blocks as they were): the shards
    # compute it and drop it with the Decode, and its recompute streams each token once.
    shard = KvScriptedShardClient(_script, num_blocks=5, block_size=4)
    engine = _engine(shard, tokenizer, decode_during_prefill=True, steps_in_flight=depth)
    prompts = [(11, 12, 13, 14), (21, 22, 23, 24), (31, 32, 33, 34)]
    try:
        results = await asyncio.gather(*(_run(engine, _request(p, 3)) for p in prompts))
    finally:
        await engine.stop()
    for prompt, events in zip(prompts, results, strict=True):
        assert [e.message for e in events if isinstance(e, ErrorEvent)] == []
        assert [e.id for e in events if isinstance(e, TokenEvent)] == _script(prompt)[:3]
    assert [request.id for request in shard.prefilled] == [0, 1, 2, 2]  # 2 recomputed
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
