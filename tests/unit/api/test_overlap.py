"""Overlapped scheduling: the engine sends step N+1 before it has processed step N's
tokens, so a request that stops at step N was already sent in step N+1. Its extra token
is computed and discarded, never streamed, and the request leaves the shards with the
next step. A request that ends by length gets no extra step at all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import (
    ErrorEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from router.tokenizer import Tokenizer
from tests.unit.api.scripted import ScriptedShardClient


class _Recorder:
    """Wraps the scripted shard: records which requests each Decode steps and removes."""

    def __init__(self, shard: ScriptedShardClient) -> None:
        self.stepped: list[list[int]] = []
        self.removed: list[list[int]] = []
        decode = shard.decode

        async def recorded(step: Any, num_rows: int) -> Any:
            response = await decode(step, num_rows)  # the shard's rows change in call order
            self.stepped.append(list(shard.rows))
            self.removed.append(list(step.finished_request_ids))
            await asyncio.sleep(0.002)  # the shards computing
            return response

        shard.decode = recorded  # type: ignore[method-assign]

    def steps_of(self, rid: int) -> int:
        return sum(rid in ids for ids in self.stepped)


def _engine(shard: ScriptedShardClient, tokenizer: Tokenizer, depth: int = 1) -> Engine:
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                             max_batch_prefill_tokens=256, steps_in_flight=depth)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    return engine


async def _events(engine: Engine, request: GenerationRequest) -> list[TokenEvent]:
    out = []
    async for event in engine.generate(request):
        assert not isinstance(event, ErrorEvent), event.message
        out.append(event)
    return out


@pytest.mark.parametrize("depth", [1, 2])
async def test_eos_stops_the_stream_and_the_extra_token_is_discarded(
    tokenizer: Tokenizer, depth: int
) -> None:
    eos = min(tokenizer.eos_token_ids)
    shard = ScriptedShardClient(lambda _p: [100, 101, eos, 102, 103, 104, 105, 106])
    recorder = _Recorder(shard)
    engine = _engine(shard, tokenizer, depth)
    try:
        request = GenerationRequest((5, 6, 7), SamplingParams(),
                                    StoppingParams(max_new_tokens=20))
        # a second, longer request keeps steps going after the first one stops
        other = GenerationRequest((8, 9), SamplingParams(),
                                  StoppingParams(max_new_tokens=12, ignore_eos=True))
        events, _ = await asyncio.gather(_events(engine, request), _events(engine, other))
    finally:
        await engine.stop()
    assert [e.id for e in events] == [100, 101, eos]
    assert events[-1].finish is not None
    assert events[-1].finish.reason == FinishReason.EOS_TOKEN
    # EOS came from decode step 2 (the prefill sampled 100); the next `depth` steps were
    # already sent with the request (their tokens computed and dropped); the one after
    # removed it
    first_id = 0
    assert recorder.steps_of(first_id) == 2 + depth
    step_without = next(i for i, ids in enumerate(recorder.stepped) if first_id not in ids)
    assert first_id in recorder.removed[step_without]
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


async def test_stop_sequence_ends_the_stream_at_its_step(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" alpha beta gamma delta epsilon zeta")
    stop_text = tokenizer.decode(ids[2:3]).strip()
    shard = ScriptedShardClient(lambda _p: ids)
    engine = _engine(shard, tokenizer)
    try:
        request = GenerationRequest(
            (5, 6, 7), SamplingParams(),
            StoppingParams(max_new_tokens=len(ids), stop_sequences=(stop_text,), ignore_eos=True),
        )
        events = await _events(engine, request)
    finally:
        await engine.stop()
    assert [e.id for e in events] == ids[:3]
    assert events[-1].finish is not None
    assert events[-1].finish.reason == FinishReason.STOP_SEQUENCE
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
async def test_length_limit_costs_no_extra_step(
    tokenizer: Tokenizer, max_new_tokens: int, depth: int
) -> None:
    shard = ScriptedShardClient(lambda _p: [100, 101, 102])
    recorder = _Recorder(shard)
    engine = _engine(shard, tokenizer, depth)
    try:
        request = GenerationRequest((5, 6, 7), SamplingParams(),
                                    StoppingParams(max_new_tokens=max_new_tokens,
                                                   ignore_eos=True))
        events = await _events(engine, request)
    finally:
        await engine.stop()
    assert len(events) == max_new_tokens
    assert events[-1].finish is not None and events[-1].finish.reason == FinishReason.LENGTH
    # the prefill samples the first token, each decode step one more: nothing wasted
    assert recorder.steps_of(0) == max_new_tokens - 1


@pytest.mark.parametrize("depth", [1, 2])
async def test_cancelled_request_streams_nothing_more(tokenizer: Tokenizer, depth: int) -> None:
    shard = ScriptedShardClient(lambda _p: list(range(100, 140)))
    recorder = _Recorder(shard)
    engine = _engine(shard, tokenizer, depth)
    try:
        request = GenerationRequest((5, 6, 7), SamplingParams(),
                                    StoppingParams(max_new_tokens=40, ignore_eos=True))
        seq = engine.submit(request)
        got: list[int] = []
        while len(got) < 3:
            event = await seq.events.get()
            assert isinstance(event, TokenEvent)
            got.append(event.id)
        engine.cancel(seq)
        steps_at_cancel = recorder.steps_of(seq.id)
        await asyncio.sleep(0.05)
        # the stream ends with the cancellation: no token after it
        leftovers = []
        while not seq.events.empty():
            leftovers.append(seq.events.get_nowait())
        assert [e for e in leftovers if isinstance(e, TokenEvent)] == []
        # at most the steps already sent ran with it; then it left the batch
        assert recorder.steps_of(seq.id) <= steps_at_cancel + depth
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
    finally:
        await engine.stop()


def _record_calls(shard: ScriptedShardClient) -> list[str]:
    """Wraps the scripted shard: the kinds of its calls in order ("prefill", "mixed"
    for a prefill that also decodes, "decode"), each taking a millisecond of
    "compute"."""
    calls: list[str] = []
    prefill, decode = shard.prefill, shard.decode

    async def recorded_prefill(step: Any) -> Any:
        calls.append("mixed" if step.decode else "prefill")
        await asyncio.sleep(0.001)
        return await prefill(step)

    async def recorded_decode(step: Any, num_rows: int) -> Any:
        calls.append("decode")
        await asyncio.sleep(0.001)
        return await decode(step, num_rows)

    shard.prefill = recorded_prefill  # type: ignore[method-assign]
    shard.decode = recorded_decode  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("decode_during_prefill", [True, False])
async def test_prefill_first_holds_decodes_until_every_newcomer_is_prefilled(
    tokenizer: Tokenizer, decode_during_prefill: bool
) -> None:
    shard = ScriptedShardClient(lambda _p: list(range(100, 110)))
    calls = _record_calls(shard)
    # one 3-token prompt per prefill step: three prefill steps for three requests
    config = SchedulerConfig(max_input_tokens=4, max_total_tokens=64, max_batch_prefill_tokens=4,
                             chunked_prefill=False, waiting_served_ratio=0,
                             decode_during_prefill=decode_during_prefill,
                             # a target set: no decode step of the rows alone to measure one
                             itl_target_s=10.0)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    try:
        seqs = [engine.submit(GenerationRequest((5, 6, i), SamplingParams(),
                                                StoppingParams(max_new_tokens=6, ignore_eos=True)))
                for i in range(3)]
        for seq in seqs:
            tokens = []
            while len(tokens) < 6:
                event = await seq.events.get()
                assert isinstance(event, TokenEvent)
                tokens.append(event.id)
            assert tokens == list(range(100, 106))  # nothing lost or repeated either way
    finally:
        await engine.stop()
    last_prefill = max(i for i, kind in enumerate(calls) if kind != "decode")
    assert calls.count("prefill") + calls.count("mixed") == 3
    assert "decode" not in calls[:last_prefill]
    if decode_during_prefill:
        # mixed steps: every step that prefills also decodes those already running, in
        # the same call
        assert calls[:3] == ["prefill", "mixed", "mixed"]
    else:
        assert "mixed" not in calls


async def test_prefill_first_cannot_hold_the_running_batch_forever(tokenizer: Tokenizer) -> None:
    # Newcomers that finish at their prefill (max_new_tokens=1) keep arriving: each step
    # has someone to prefill, and admission never runs out. The running request still
    # decodes, at least once every max_waiting_tokens prefill steps.
    shard = ScriptedShardClient(lambda _p: list(range(100, 110)))
    calls = _record_calls(shard)
    config = SchedulerConfig(max_input_tokens=4, max_total_tokens=64, max_batch_prefill_tokens=4,
                             chunked_prefill=False, waiting_served_ratio=0,
                             max_waiting_tokens=3, decode_during_prefill=False)
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    engine.start()
    stop = asyncio.Event()

    async def feeder() -> None:
        one_token = StoppingParams(max_new_tokens=1, ignore_eos=True)
        while not stop.is_set():
            if len(engine.scheduler.waiting) < 3:
                engine.submit(GenerationRequest((7, 8, 9), SamplingParams(), one_token))
            await asyncio.sleep(0)

    try:
        long = engine.submit(GenerationRequest((5, 6, 7), SamplingParams(),
                                               StoppingParams(max_new_tokens=10,
                                                              ignore_eos=True)))
        feeding = asyncio.create_task(feeder())
        tokens: list[int] = []
        async with asyncio.timeout(20):
            while len(tokens) < 10:
                event = await long.events.get()
                assert isinstance(event, TokenEvent)
                tokens.append(event.id)
        stop.set()
        await feeding
    finally:
        stop.set()
        await engine.stop()
    assert tokens == list(range(100, 110))
    # never more than max_waiting_tokens prefill-only steps between two decodes
    runs = "".join("p" if kind == "prefill" else "d" for kind in calls).split("d")
    assert max(len(run) for run in runs[1:-1]) <= 3 + 1  # + the step that also decodes
    assert calls.count("prefill") > 9  # the newcomers were indeed prefilled meanwhile
