"""Mixed steps through the engine: a long prompt arriving while streams decode is
prefilled in chunks that ride with the running rows, each sized so the step takes about
the ITL target (--itl-target), from the step times the shards report."""

from __future__ import annotations

import asyncio
from typing import Any

from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams, TokenEvent
from router.tokenizer import Tokenizer
from shard.pb import shard_pb2 as pb
from tests.unit.api.scripted import ScriptedShardClient

# the scripted shards' step time: a decode step's, plus this much per prompt token
DECODE_S, PER_TOKEN_S, TARGET_S = 0.001, 0.0001, 0.02


def _timed(shard: ScriptedShardClient) -> list[tuple[bool, int]]:
    """Wraps the scripted shard so each step reports a forward time of DECODE_S +
    PER_TOKEN_S × its prompt tokens; returns (decodes too, prompt tokens) per Prefill."""
    prefills: list[tuple[bool, int]] = []
    prefill, decode = shard.prefill, shard.decode

    async def timed_prefill(step: pb.PrefillRequest) -> pb.PrefillResponse:
        tokens = sum(r.num_tokens or len(r.input_ids) - r.cache_len for r in step.new_requests)
        for c in step.cached_requests:
            held = shard.requests[c.id]
            tokens += c.num_tokens or held.total - held.computed
        prefills.append((step.decode, tokens))
        response = await prefill(step)
        response.timings.forward_ns = int((DECODE_S + PER_TOKEN_S * tokens) * 1e9)
        await asyncio.sleep(0.001)
        return response

    async def timed_decode(step: pb.DecodeRequest, num_rows: int) -> Any:
        response = await decode(step, num_rows)
        response.timings.forward_ns = int(DECODE_S * 1e9)
        await asyncio.sleep(0.001)
        return response

    shard.prefill = timed_prefill  # type: ignore[method-assign]
    shard.decode = timed_decode  # type: ignore[method-assign]
    return prefills


async def test_a_long_prompt_rides_with_the_rows_in_chunks_sized_by_the_target(
    tokenizer: Tokenizer,
) -> None:
    shard = ScriptedShardClient(lambda _p: list(range(100, 110)), num_blocks=512)
    prefills = _timed(shard)
    config = SchedulerConfig(max_input_tokens=3000, max_total_tokens=4000,
                             max_batch_prefill_tokens=1024, itl_target_s=TARGET_S,
                             waiting_served_ratio=0)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    long_stop = StoppingParams(max_new_tokens=2, ignore_eos=True)
    try:
        streams = [engine.submit(GenerationRequest(
            (5, 6, i), SamplingParams(), StoppingParams(max_new_tokens=150, ignore_eos=True)))
            for i in range(2)]
        for seq in streams:  # both decode before the long prompt comes
            assert isinstance(await seq.events.get(), TokenEvent)
        start = len(prefills)
        long = engine.submit(GenerationRequest(tuple(3 + i % 90 for i in range(2500)),
                                               SamplingParams(), long_stop))
        for _ in range(2):
            assert isinstance(await long.events.get(), TokenEvent)
        for seq in streams:
            tokens = 1
            while tokens < 150:
                event = await seq.events.get()
                assert isinstance(event, TokenEvent)
                tokens += 1
    finally:
        await engine.stop()
    chunks = prefills[start:]
    assert sum(tokens for _, tokens in chunks) == 2500
    # every chunk went with the running rows, in one forward
    assert all(decodes for decodes, _ in chunks)
    # the first chunk is sized from the short prompts' prefill (which overstates the
    # cost per token); the estimate then converges: the later steps take the target
    fits = (TARGET_S - DECODE_S) / PER_TOKEN_S
    assert len(chunks) >= 10
    for _, tokens in chunks[:-1]:
        assert DECODE_S + PER_TOKEN_S * tokens <= TARGET_S * 1.05
    for _, tokens in chunks[6:-1]:
        assert abs(tokens - fits) <= 0.05 * fits
