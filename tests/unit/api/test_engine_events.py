"""When the engine hands token events to the streams: after the next shard call is sent,
so the stream handlers' work overlaps the shards' compute instead of delaying it."""

from __future__ import annotations

import asyncio
from typing import Any

from router.config import SchedulerConfig
from router.engine import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer
from tests.unit.api.scripted import ScriptedShardClient


async def test_tokens_reach_the_stream_after_the_next_call_is_sent(tokenizer: Tokenizer) -> None:
    log: list[str] = []
    shard = ScriptedShardClient(lambda _prompt: [100, 101, 102, 103, 104])
    prefill, decode = shard.prefill, shard.decode

    async def logged_prefill(*args: Any, **kwargs: Any) -> Any:
        log.append("prefill sent")
        return await prefill(*args, **kwargs)

    async def logged_decode(*args: Any, **kwargs: Any) -> Any:
        log.append("decode sent")
        await asyncio.sleep(0.01)  # the shards computing
        return await decode(*args, **kwargs)

    shard.prefill, shard.decode = logged_prefill, logged_decode  # type: ignore[method-assign]
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                             max_batch_prefill_tokens=256)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    try:
        request = GenerationRequest(
            (5, 6, 7), SamplingParams(), StoppingParams(max_new_tokens=5, ignore_eos=True)
        )
        async for event in engine.generate(request):
            log.append(f"got {event.id}")
    finally:
        await engine.stop()
    # overlapped: the first decode goes out with the prefill (the shard feeds the
    # prefill's token forward), each later step before the previous one's tokens are
    # processed, and tokens reach the stream once a later step is under way; exactly
    # four decodes for five tokens (the prefill samples the first), none wasted
    # after the last; the last tokens, with no step after them, when the engine idles
    assert log == [
        "prefill sent", "decode sent", "decode sent", "got 100", "decode sent", "got 101",
        "decode sent", "got 102", "got 103", "got 104",
    ]
