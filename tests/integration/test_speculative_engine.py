"""Speculative decoding through router engine → gRPC shard (n-gram guesses): greedy
tokens equal transformers' and those of the same engine without speculation, alone and
batched, within max_new_tokens, with stop sequences, logprobs and a forced preemption;
the guesses are counted and verified (acceptance > 0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from router.engine.loop import Engine
from router.request import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from tests.integration.test_engine_tiny import make_engine, reference_tokens

# Three prompts of different lengths; repeating_model_dir (conftest.py) repeats itself (its
# layers' outputs scaled down, the tied embeddings favour the last token), so n-gram
# guesses are both accepted and rejected.
PROMPTS = [
    "one two three one two three one two three one two",
    "The capital of France is",
    "a b c d e f g a b c d e f g a b c d",
]
MAX_NEW_TOKENS = [40, 23, 37]


@pytest.fixture
async def spec_shard_address(repeating_model_dir: Path) -> AsyncIterator[str]:
    """A gRPC shard of the repeating model that proposes n-gram guesses."""
    from shard.config import ShardConfig
    from shard.server import start_server

    config = ShardConfig(model_path=str(repeating_model_dir), dtype="float32", device="cpu",
                         kv_cache_bytes=8 * 1024 * 1024, speculative_method="ngram",
                         ngram_min=1, ngram_max=3)
    server, port = await start_server(config, host="127.0.0.1", port=0)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest.fixture(scope="module")
def expected(repeating_model_dir: Path) -> list[list[int]]:
    from router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(repeating_model_dir)
    return [reference_tokens(repeating_model_dir, tokenizer.encode(p), n)
            for p, n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True)]


def request(engine: Engine, prompt: str, max_new_tokens: int, **stopping: Any
            ) -> GenerationRequest:
    return GenerationRequest(
        input_ids=tuple(engine.tokenizer.encode(prompt)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **stopping),
        top_n_tokens=2,
    )


async def run(engine: Engine, req: GenerationRequest) -> list[TokenEvent]:
    events = []
    async for event in engine.generate(req):
        assert not isinstance(event, ErrorEvent), event.message
        events.append(event)
    return events


async def speculative_engine(address: str, model_dir: Path, **config: Any) -> Engine:
    return await make_engine(address, model_dir, num_speculative_tokens=3, **config)


def counter(engine: Engine, name: str) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(f"shardserve_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.parametrize("config", [
    {},
    {"steps_in_flight": 2},  # plain steps overlapped two deep between speculative ones
    {"speculative_disable_batch_size": 2},  # the batch of 3 decodes plainly until one ends
], ids=["default", "two-in-flight", "batch-limit"])
async def test_greedy_tokens_equal_transformers_alone_and_batched(
        spec_shard_address: str, repeating_model_dir: Path, expected: list[list[int]],
        config: dict[str, int]) -> None:
    engine = await speculative_engine(spec_shard_address, repeating_model_dir, **config)
    baseline = engine.block_manager.num_free
    try:
        for prompt, n, want in zip(PROMPTS, MAX_NEW_TOKENS, expected, strict=True):
            events = await run(engine, request(engine, prompt, n))
            assert [e.id for e in events] == want  # never past max_new_tokens
        batched = await asyncio.gather(*(run(engine, request(engine, p, n))
                                         for p, n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True)))
        assert [[e.id for e in events] for events in batched] == expected
        assert engine.block_manager.num_free == baseline
        proposed = counter(engine, "spec_decode_proposed_tokens_total")
        accepted = counter(engine, "spec_decode_accepted_tokens_total")
        assert 0 < accepted <= proposed
        for step in ("verify", "propose"):
            assert counter(engine, f"spec_decode_{step}_step_duration_seconds_count") > 0
            assert counter(engine, f"spec_decode_{step}_step_duration_seconds_sum") > 0
    finally:
        await engine.stop()
        await engine.shards.client.close()


async def test_logprobs_and_top_tokens_equal_those_without_speculation(
        spec_shard_address: str, repeating_model_dir: Path) -> None:
    engine = await speculative_engine(spec_shard_address, repeating_model_dir)
    try:
        spec = await run(engine, request(engine, PROMPTS[0], 30))
    finally:
        await engine.stop()
        await engine.shards.client.close()
    plain_engine = await make_engine(spec_shard_address, repeating_model_dir)
    try:
        plain = await run(plain_engine, request(plain_engine, PROMPTS[0], 30))
    finally:
        await plain_engine.stop()
        await plain_engine.shards.client.close()
    assert [e.id for e in spec] == [e.id for e in plain]
    assert [e.logprob for e in spec] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    assert [[t.token_id for t in e.top_tokens] for e in spec] == [
        [t.token_id for t in e.top_tokens] for e in plain]


async def test_a_stop_sequence_inside_an_accepted_run_ends_the_text_there(
        spec_shard_address: str, repeating_model_dir: Path, expected: list[list[int]]) -> None:
    """Reference tokens 4-13 of prompt 0 are one token repeated: from token 6 on they
    come as accepted guesses, two or more per step. A stop sequence of tokens 4-6 ends
    the text at token 6; the step's token after it is not streamed."""
    engine = await speculative_engine(spec_shard_address, repeating_model_dir)
    try:
        want = expected[0]
        assert len(set(want[4:14])) == 1
        stop_text = engine.tokenizer.decode(want[4:7])
        events = await run(engine, request(engine, PROMPTS[0], 40, stop_sequences=(stop_text,)))
        text = "".join(e.text for e in events)
        full = engine.tokenizer.decode(want)
        # the text ends with the stop sequence's first occurrence (TGI keeps it)
        assert text == full[: full.index(stop_text) + len(stop_text)]
        assert len(events) == 7 and events[-1].finish is not None
    finally:
        await engine.stop()
        await engine.shards.client.close()


async def test_a_preempted_request_resumes_with_the_same_tokens(
        spec_shard_address: str, repeating_model_dir: Path, expected: list[list[int]]) -> None:
    """A KV cache so small that the batch cannot grow: requests are preempted and
    recomputed, and their tokens are still transformers'."""
    engine = await speculative_engine(spec_shard_address, repeating_model_dir, num_blocks=12)
    try:
        batched = await asyncio.gather(*(run(engine, request(engine, p, n))
                                         for p, n in zip(PROMPTS, MAX_NEW_TOKENS, strict=True)))
        assert [[e.id for e in events] for events in batched] == expected
        assert engine.block_manager.num_free == 12
    finally:
        await engine.stop()
        await engine.shards.client.close()
