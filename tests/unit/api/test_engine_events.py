"""When the engine hands token events to the streams: after the next shard call is sent,
so the stream handlers' work overlaps the shards' compute instead of delaying it."""

from __future__ import annotations

import asyncio
import gc
from array import array
from dataclasses import replace
from typing import Any

from router.api.generation import run_all
from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import (
    EventStream,
    GenerationRequest,
    SamplingParams,
    Sequence,
    StoppingParams,
    TokenEvent,
    TopToken,
)
from router.shard_steps import TokenExtras
from router.tokenizer import Tokenizer
from tests.unit.api.scripted import ScriptedShardClient


def _started_engine(shard: ScriptedShardClient, tokenizer: Tokenizer) -> Engine:
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                             max_batch_prefill_tokens=256)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    return engine


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
    engine = _started_engine(shard, tokenizer)
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


async def _texts(engine: Engine, request: GenerationRequest) -> list[str]:
    texts = []
    async with asyncio.timeout(30.0):  # a stream left waiting fails here, not hangs
        async for event in engine.generate(request):
            assert isinstance(event, TokenEvent), event
            texts.append(event.text)
    return texts


async def test_whole_answers_decode_their_text_once_at_the_end(tokenizer: Tokenizer) -> None:
    said = tokenizer.encode(" café 🤗 and so on, stop here and more", add_special_tokens=False)
    shard = ScriptedShardClient(lambda _prompt: said)
    engine = _started_engine(shard, tokenizer)
    try:
        for cut in (len(said), len(said) - 5):
            stopping = StoppingParams(max_new_tokens=cut, ignore_eos=True)
            request = GenerationRequest((5, 6, 7), SamplingParams(), stopping, stream=False)
            per_token = await _texts(engine, request)
            once = await _texts(engine, replace(request, token_texts=False))
            # the same text, carried whole by the last event
            assert len(once) == len(per_token) == cut
            assert once[:-1] == [""] * (cut - 1) and once[-1] == "".join(per_token)
            assert sum(map(bool, per_token)) > 1
        # stop strings are matched token by token whatever the caller reads
        stopping = StoppingParams(max_new_tokens=len(said), stop_sequences=(" stop",),
                                  ignore_eos=True)
        request = GenerationRequest((5, 6, 7), SamplingParams(), stopping, stream=False,
                                    token_texts=False)
        texts = await _texts(engine, request)
        assert "".join(texts) == " café 🤗 and so on, stop" and sum(map(bool, texts)) > 1
    finally:
        await engine.stop()


async def test_whole_answers_handed_over_at_once_arrive_complete(tokenizer: Tokenizer) -> None:
    said = list(range(100, 140))
    shard = ScriptedShardClient(lambda _prompt: said)
    engine = _started_engine(shard, tokenizer)
    try:
        stopping = StoppingParams(max_new_tokens=len(said), ignore_eos=True)
        requests = [GenerationRequest((5, 6, 7), SamplingParams(), stopping),
                    GenerationRequest((8, 9), SamplingParams(), stopping)]
        # several requests (merged through their pumps) and one (read directly)
        for batch in (requests, requests[:1]):
            # a stream left waiting after its events arrived fails here, not hangs
            answers = await asyncio.wait_for(run_all(engine, batch, token_texts=False), 30.0)
            for done in answers:
                assert [event.id for event in done.tokens] == said
                assert done.finish is not None and done.finish.generated_tokens == len(said)
    finally:
        await engine.stop()


async def test_a_whole_answer_is_read_without_building_its_events(
    tokenizer: Tokenizer,
) -> None:
    # text, logprob sum and count come from the held columns; the events are built only
    # when read, and then equal those the engine yields one by one
    said = tokenizer.encode(" one two three four", add_special_tokens=False)
    shard = ScriptedShardClient(lambda _prompt: said)
    engine = _started_engine(shard, tokenizer)
    try:
        stopping = StoppingParams(max_new_tokens=len(said), ignore_eos=True)
        request = GenerationRequest((5, 6, 7), SamplingParams(), stopping)
        for token_texts in (False, True):
            [done] = await asyncio.wait_for(run_all(engine, [request], token_texts=token_texts),
                                            30.0)
            assert done.answer is not None and done.events == []
            text, total, count = done.text, done.logprob_sum, done.num_generated
            prompt_logprobs = done.prompt_logprobs
            assert done.answer is not None  # none of those built the events
            events = done.tokens
            assert done.answer is None and done.tokens is events
            # the events the engine's generate yields for the same request, one by one
            held = replace(request, stream=False, token_texts=token_texts)
            assert events == await _events(engine, held)
            streamed = await _events(engine, request)
            assert [(e.id, e.logprob) for e in events] == [(e.id, e.logprob) for e in streamed]
            assert text == "".join(e.text for e in streamed) == " one two three four"
            assert total == sum(e.logprob for e in streamed) and count == len(said)
            assert prompt_logprobs == ()
    finally:
        await engine.stop()


async def test_an_event_stream_takes_a_list_in_order_with_one_wake_up() -> None:
    stream = EventStream()
    events = [TokenEvent(id=i, logprob=0.0, text=str(i), special=False) for i in range(5)]
    reader = asyncio.create_task(stream.get())
    await asyncio.sleep(0)  # the reader waits
    stream.put_all(events)
    stream.put_all([])
    assert await asyncio.wait_for(reader, 5.0) is events[0]  # woken, not left waiting
    assert [stream.get_nowait() for _ in range(4)] == events[1:] and stream.empty()


async def test_the_decode_period_leaves_out_periods_with_a_prefill(tokenizer: Tokenizer) -> None:
    shard = ScriptedShardClient(lambda _prompt: [100, 101, 102])
    engine = _started_engine(shard, tokenizer)
    log: list[str] = []
    metrics = engine.metrics
    for name in ("prefill_step", "decode_step", "decode_step_wall"):
        histogram = getattr(metrics, name)
        histogram.observe = lambda _value, name=name: log.append(name)  # type: ignore[method-assign]
    decode = shard.decode

    async def slow_decode(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.005)  # the shards computing: the second prompt arrives
        return await decode(*args, **kwargs)

    shard.decode = slow_decode  # type: ignore[method-assign]

    async def one(prompt: tuple[int, ...], delay: float) -> None:
        await asyncio.sleep(delay)
        stopping = StoppingParams(max_new_tokens=12, ignore_eos=True)
        async for _ in engine.generate(GenerationRequest(prompt, SamplingParams(), stopping)):
            pass

    try:
        await asyncio.gather(one((5, 6, 7), 0.0), one((8, 9), 0.03))
    finally:
        await engine.stop()
    steps = [name for name in log if name != "decode_step_wall"]
    assert steps.count("prefill_step") == 2 and steps.count("decode_step") >= 12
    # each decode result counts its period unless a prefill result came since the last
    for index, name in enumerate(log):
        if name != "decode_step":
            continue
        before = [n for n in log[:index] if n != "decode_step_wall"]
        after_prefill = not before or before[-1] == "prefill_step"
        assert (log[index - 1] == "decode_step_wall") != after_prefill, (index, log)


async def test_an_idle_engine_reads_its_last_step_at_once(tokenizer: Tokenizer) -> None:
    # A request that ends at EOS leaves the step sent after its last token in flight;
    # that step is read at once, not when the next request wakes the engine (whose
    # wait would otherwise count as one decode step).
    eos = min(tokenizer.eos_token_ids)
    shard = ScriptedShardClient(lambda _prompt: [100, 101, eos, 102, 103])
    engine = _started_engine(shard, tokenizer)
    walls: list[float] = []
    engine.metrics.decode_step_wall.observe = walls.append  # type: ignore[method-assign]
    stopping = StoppingParams(max_new_tokens=10)
    try:
        for _ in range(2):
            events = [e async for e in engine.generate(
                GenerationRequest((5, 6, 7), SamplingParams(), stopping))]
            assert events[-1].finish is not None and len(events) == 3
            await asyncio.sleep(0.3)
            assert not engine.inflight
    finally:
        await engine.stop()
    assert walls and max(walls) < 0.2, walls


async def _events(engine: Engine, request: GenerationRequest) -> list[TokenEvent]:
    events = []
    async with asyncio.timeout(30.0):
        async for event in engine.generate(request):
            assert isinstance(event, TokenEvent), event
            events.append(event)
    return events


async def test_a_whole_answer_carries_the_events_a_stream_does(tokenizer: Tokenizer) -> None:
    # held until the end in a compact form, then handed over as the same events: ids,
    # logprobs, texts, special flags, alternatives, prompt logprobs and the finish
    said = [*tokenizer.encode(" one two three", add_special_tokens=False),
            *tokenizer.eos_token_ids]
    shard = ScriptedShardClient(lambda _prompt: said)
    engine = _started_engine(shard, tokenizer)
    try:
        for extras in ({}, {"top_n_tokens": 2, "prompt_logprobs": True}):
            stopping = StoppingParams(max_new_tokens=len(said) + 3, ignore_eos=True)
            request = GenerationRequest((5, 6, 7), SamplingParams(), stopping, **extras)
            streamed = await _events(engine, request)
            whole = await _events(engine, replace(request, stream=False))
            assert whole == streamed
            assert len(whole) == len(said) + 3 and whole[-1].finish is not None
            assert any(e.special for e in whole) and not all(e.special for e in whole)
            assert bool(whole[0].top_tokens) == bool(extras)
    finally:
        await engine.stop()


async def test_held_events_are_not_scanned_by_the_garbage_collector(
    tokenizer: Tokenizer,
) -> None:
    # a whole answer's events wait in its sequence until the end: held as columns of
    # plain values, not one object per token for every full collection to scan (a pause
    # of the engine loop); an event with alternatives keeps its form
    shard = ScriptedShardClient(lambda _prompt: [100, 101, 102])
    engine = _started_engine(shard, tokenizer)
    await engine.stop()
    output = engine.output  # driven by hand
    stopping = StoppingParams(max_new_tokens=10, ignore_eos=True)
    plain = Sequence(1, GenerationRequest((5, 6), SamplingParams(), stopping, stream=False))
    rich = Sequence(2, GenerationRequest((5, 6), SamplingParams(), stopping, stream=False,
                                         top_n_tokens=1))
    for seq in (plain, rich):
        output.add(seq)
        for token in (100, 101):
            seq.output_ids.append(token)
            extras = TokenExtras((TopToken(token, -0.5),), ()) if seq is rich else None
            assert output.on_token(seq, token, -0.5, extras) is None
    output.deliver()
    assert plain.held is not None and rich.held is not None
    assert list(plain.held.ids) == [100, 101] and plain.held.rich == {}
    # per token: a slot of an array and a str, which the collector does not track
    assert isinstance(plain.held.ids, array) and isinstance(plain.held.logprobs, array)
    assert not any(gc.is_tracked(text) for text in plain.held.texts.values())
    assert sorted(rich.held.rich) == [0, 1]
    assert [e.top_tokens for e in rich.held.events()] == [(TopToken(100, -0.5),),
                                                          (TopToken(101, -0.5),)]
    assert plain.events.empty() and rich.events.empty()  # nothing before the finish
