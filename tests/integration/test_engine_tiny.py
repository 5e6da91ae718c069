"""Greedy tokens through router engine → gRPC shard equal transformers ``generate``.

Prompts of different lengths run one at a time, and together in one running batch that
they join at different decode steps (continuous batching).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import ErrorEvent, GenerationRequest, SamplingParams, StoppingParams
from router.shard_client import ShardClient
from router.tokenizer import Tokenizer

PROMPTS = [
    "Hi",
    "The capital of France is",
    "A much longer prompt that spans more than one KV block of sixteen tokens, so the "
    "block table has several entries.",
    "Once upon a time, in a land far away, there lived a",
]
MAX_NEW_TOKENS = [24, 16, 20, 30]


def reference_tokens(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return [int(t) for t in output[0, len(prompt_ids) :]]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    return [
        reference_tokens(tiny_model_dir, tokenizer.encode(prompt), n)
        for prompt, n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True)
    ]


async def make_engine(
    address: str, model_dir: Path, num_blocks: int | None = None, **config: Any
) -> Engine:
    client = ShardClient([address])
    await client.wait_ready(30)
    warmed_up = await client.warmup(256, 512)
    num_blocks = min(num_blocks or warmed_up, warmed_up)
    info = (await client.info())[0]
    budgets = {"max_batch_prefill_tokens": 256, "max_input_tokens": 128,
               "max_total_tokens": 512, **config}
    engine = Engine(client, Tokenizer.from_folder(model_dir), SchedulerConfig(**budgets),
                    num_blocks, info.block_size)
    engine.start()
    return engine


def greedy_request(tokenizer: Tokenizer, prompt: str, max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        input_ids=tuple(tokenizer.encode(prompt)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def collect(engine: Engine, request: GenerationRequest, started: asyncio.Event | None = None,
                  after_tokens: int = 0) -> list[int]:
    tokens: list[int] = []
    async for event in engine.generate(request):
        assert not isinstance(event, ErrorEvent), event.message
        tokens.append(event.id)
        if started is not None and len(tokens) == after_tokens:
            started.set()
    return tokens


async def test_one_at_a_time(
    tiny_shard_address: str, tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    engine = await make_engine(tiny_shard_address, tiny_model_dir)
    baseline = engine.block_manager.num_free
    try:
        for prompt, n, want in zip(PROMPTS, MAX_NEW_TOKENS, expected, strict=True):
            assert await collect(engine, greedy_request(engine.tokenizer, prompt, n)) == want
        assert engine.block_manager.num_free == baseline
    finally:
        await engine.stop()
        await engine.shards.client.close()


async def test_joining_the_running_batch_at_different_steps(
    tiny_shard_address: str, tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    engine = await make_engine(tiny_shard_address, tiny_model_dir)
    baseline = engine.block_manager.num_free
    try:
        tasks = []
        # Request i+1 is submitted once request i has produced (2 + i) tokens.
        for index, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW_TOKENS, strict=True)):
            started = asyncio.Event()
            request = greedy_request(engine.tokenizer, prompt, n)
            tasks.append(asyncio.create_task(collect(engine, request, started, 2 + index)))
            await asyncio.wait_for(started.wait(), timeout=60)
        results = await asyncio.gather(*tasks)
        assert results == expected
        assert engine.block_manager.num_free == baseline
    finally:
        await engine.stop()
        await engine.shards.client.close()


@pytest.mark.parametrize("steps_in_flight", [1, 2])
async def test_all_together_with_preemption(
    tiny_shard_address: str, tiny_model_dir: Path, expected: list[list[int]],
    steps_in_flight: int,
) -> None:
    # 4 blocks of 16 tokens: each request fits alone (at most 3 blocks), but the two
    # longest (14 + 30 and 24 + 20 tokens) run out of blocks together. With steps in
    # flight, a preempted request's tokens already being computed are discarded.
    engine = await make_engine(tiny_shard_address, tiny_model_dir, num_blocks=4,
                               steps_in_flight=steps_in_flight)
    preempted: list[int] = []
    original = engine.scheduler._preempt

    def spy(seq):  # type: ignore[no-untyped-def]
        preempted.append(seq.id)
        original(seq)

    engine.scheduler._preempt = spy  # type: ignore[method-assign]
    try:
        order = [3, 2, 0, 1]
        requests = [greedy_request(engine.tokenizer, PROMPTS[i], MAX_NEW_TOKENS[i]) for i in order]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        assert results == [expected[i] for i in order]
        assert preempted, "the tiny KV budget should have forced a preemption"
        assert engine.block_manager.num_free == 4
    finally:
        await engine.stop()
        await engine.shards.client.close()


SHARED = (
    "You are a terse assistant. Answer in one short sentence, never more, and never ask "
    "a question back. Use plain words, no lists, no markdown, no emoji, no quotes. If you "
    "do not know, say so. Question: "
)
SUFFIXES = ["what is two plus two?", "name a colour.", "what is the capital of Spain?"]


async def test_prefix_cache_hits_and_eviction_give_identical_tokens(
    tiny_shard_address: str, tiny_model_dir: Path
) -> None:
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    prompts = [SHARED + suffix for suffix in SUFFIXES]
    want = [reference_tokens(tiny_model_dir, tokenizer.encode(p), 12) for p in prompts]
    # 6 blocks: enough for one request at a time, so later ones evict cached blocks.
    for prefix_caching in (True, False):
        engine = await make_engine(tiny_shard_address, tiny_model_dir, num_blocks=6,
                                   prefix_caching=prefix_caching)
        try:
            got = []
            for prompt in [*prompts, *prompts[::-1]]:
                got.append(await collect(engine, greedy_request(tokenizer, prompt, 12)))
            assert got == [*want, *want[::-1]]
            hits = engine.block_manager.hit_tokens
            if prefix_caching:
                assert hits >= 48 * (len(got) - 1), "the shared prefix should be reused"
            else:
                assert hits == 0
            assert engine.block_manager.num_free == 6
        finally:
            await engine.stop()
            await engine.shards.client.close()


async def test_chunked_prefill_gives_identical_tokens(
    tiny_shard_address: str, tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    # A 7-token prefill budget splits the longer prompts into several chunks, which
    # share steps with the decodes of the requests already running.
    engine = await make_engine(tiny_shard_address, tiny_model_dir,
                               max_batch_prefill_tokens=7, max_input_tokens=64)
    try:
        requests = [
            greedy_request(engine.tokenizer, p, n)
            for p, n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True)
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        assert results == expected
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
    finally:
        await engine.stop()
        await engine.shards.client.close()


async def test_same_prompt_alone_and_in_batches_of_any_size_m6(
    tiny_shard_address: str, tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    engine = await make_engine(tiny_shard_address, tiny_model_dir)
    target = greedy_request(engine.tokenizer, PROMPTS[1], MAX_NEW_TOKENS[1])
    try:
        for batch_size in (1, 3, 8):
            neighbours = [
                greedy_request(engine.tokenizer, PROMPTS[i % 4] + " x" * i, 10 + i)
                for i in range(batch_size - 1)
            ]
            results = await asyncio.gather(
                *(collect(engine, r) for r in [*neighbours, target, *neighbours])
            )
            assert results[len(neighbours)] == expected[1], f"batch of {2 * batch_size - 1}"
    finally:
        await engine.stop()
        await engine.shards.client.close()
