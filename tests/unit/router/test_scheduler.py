"""Scheduler admission, chunked prefill, prefix reuse, block reservation and preemption
(no shards involved)."""

from __future__ import annotations

from typing import Any

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.request import GenerationRequest, SamplingParams, Sequence, Status, StoppingParams
from router.scheduler import Scheduler
from router.scheduler_output import PrefillChunk


def make_seq(seq_id: int, prompt_len: int, first_token: int = 1) -> Sequence:
    request = GenerationRequest(
        input_ids=tuple(range(first_token, first_token + prompt_len)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=64),
    )
    return Sequence(id=seq_id, request=request)


def make_scheduler(num_blocks: int, prefill: int = 64, chunked: bool = True) -> Scheduler:
    config = SchedulerConfig(max_input_tokens=min(64, prefill), max_total_tokens=128,
                             max_batch_prefill_tokens=prefill, chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, block_size=4))


def prefill_all(scheduler: Scheduler) -> list[PrefillChunk]:
    chunks = scheduler.schedule_prefill()
    for chunk in chunks:
        scheduler.on_prefilled(chunk)
    return chunks


def test_admission_respects_prefill_budget_and_is_fifo() -> None:
    scheduler = make_scheduler(100, prefill=20, chunked=False)
    seqs = [make_seq(i, 8, first_token=10 * i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert [c.seq for c in prefill_all(scheduler)] == seqs[:2]
    assert [len(s.block_ids) for s in seqs[:2]] == [2, 2]
    assert [c.seq for c in prefill_all(scheduler)] == seqs[2:]
    assert scheduler.running == seqs


def test_chunked_prefill_splits_long_prompts_across_steps() -> None:
    scheduler = make_scheduler(100, prefill=16)
    running, long = make_seq(0, 4), make_seq(1, 40, first_token=100)
    scheduler.add(running)
    prefill_all(scheduler)
    scheduler.add(long)
    spans = []
    while long.status is not Status.RUNNING:
        (chunk,) = prefill_all(scheduler)
        spans.append((chunk.cache_len, chunk.end, chunk.partial))
        running.output_ids.append(5)  # the running sequence decodes meanwhile
        scheduler.plan_decode()
    assert spans == [(0, 16, True), (16, 32, True), (32, 40, False)]
    assert scheduler.running == [running, long]


def test_prefix_blocks_are_reused() -> None:
    scheduler = make_scheduler(100)
    first, second = make_seq(0, 10), make_seq(1, 10)
    scheduler.add(first)
    prefill_all(scheduler)
    scheduler.finish(first)
    scheduler.add(second)
    (chunk,) = prefill_all(scheduler)
    # Two full blocks (8 tokens) are cached; the last partial block is recomputed.
    assert chunk.cache_len == 8 and chunk.end == 10
    assert scheduler.block_manager.hit_tokens == 8


def test_blocks_allocated_on_demand() -> None:
    scheduler = make_scheduler(100)
    seq = make_seq(0, 4)
    scheduler.add(seq)
    prefill_all(scheduler)
    assert len(seq.block_ids) == 1
    seq.output_ids.append(7)  # 5 tokens: the new one needs a second block
    plan = scheduler.plan_decode()
    assert plan.block_appends == {0: seq.block_ids[1:]} and len(seq.block_ids) == 2
    assert scheduler.plan_decode().block_appends == {}


def test_newest_is_preempted_when_blocks_run_out() -> None:
    scheduler = make_scheduler(4)
    old, new = make_seq(0, 8), make_seq(1, 4, first_token=50)
    scheduler.add(old)
    prefill_all(scheduler)
    scheduler.add(new)
    assert [c.seq for c in prefill_all(scheduler)] == [new]
    assert scheduler.block_manager.num_free == 1
    old.output_ids.append(1)  # 9 tokens: needs a third block
    new.output_ids.extend([1, 2])  # 6 tokens: needs a second block
    plan = scheduler.plan_decode()
    assert plan.preempted == [new] and new.status is Status.WAITING
    assert scheduler.waiting[0] is new and new.block_ids == []
    assert plan.block_appends == {0: old.block_ids[2:]}
    scheduler.finish(old)
    (chunk,) = prefill_all(scheduler)
    assert chunk.seq is new and chunk.end == 6  # recomputes prompt + output
    assert len(new.block_ids) == 2
    scheduler.finish(new)
    scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_free == 4


def test_prefill_budget_holds_for_unsplittable_prompt_logprobs() -> None:
    scheduler = make_scheduler(100, prefill=64)
    plain = make_seq(0, 60)
    logprobs = make_seq(1, 60, first_token=100)
    logprobs.request = GenerationRequest(
        input_ids=logprobs.request.input_ids, sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=8), prompt_logprobs=True,
    )
    scheduler.add(plain)
    scheduler.add(logprobs)
    first = scheduler.schedule_prefill()
    assert [c.seq for c in first] == [plain]
    assert sum(c.num_tokens for c in first) <= 64
    for chunk in first:
        scheduler.on_prefilled(chunk)
    (second,) = scheduler.schedule_prefill()
    assert second.seq is logprobs and second.num_tokens == 60 and not second.partial


def test_recompute_after_preemption_is_chunked_even_without_chunked_prefill() -> None:
    scheduler = make_scheduler(100, prefill=32, chunked=False)
    seq = make_seq(0, 30)
    scheduler.add(seq)
    prefill_all(scheduler)
    seq.output_ids.extend(range(50))  # 80 tokens to recompute
    scheduler._preempt(seq)
    spans = []
    while seq.status is not Status.RUNNING:
        chunks = prefill_all(scheduler)
        assert sum(c.num_tokens for c in chunks) <= 32
        spans += [(c.cache_len, c.end) for c in chunks]
    assert spans[-1][1] == 80 and all(end - start <= 32 for start, end in spans)


def test_decoding_sequences_keep_consecutive_block_tables() -> None:
    """Sequences admitted together and decoded in lockstep each append the id after
    their last block (reserved for their max_new_tokens at admission), so every table
    stays one run; finishing returns the reservations."""
    scheduler = make_scheduler(200, prefill=64)
    seqs = [make_seq(i, 6 + 5 * i, first_token=100 * i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    prefill_all(scheduler)
    assert scheduler.block_manager.num_reserved > 0
    for _ in range(40):
        for seq in seqs:
            seq.output_ids.append(5)
        assert not scheduler.plan_decode().preempted
    for seq in seqs:
        assert len(seq.block_ids) == -(-seq.num_tokens // 4)
        assert seq.block_ids == list(range(seq.block_ids[0], seq.block_ids[0] + len(seq.block_ids)))
    for seq in seqs:
        scheduler.finish(seq)
    assert scheduler.block_manager.num_free == 200
    assert scheduler.block_manager.num_reserved == 0
    scheduler.block_manager.check_integrity()


def test_a_recompute_is_sent_once_in_full_then_chunk_by_chunk() -> None:
    """A recompute after preemption is prefilled in chunks of prompt + generated tokens:
    its first chunk sends every token once (saying how many were generated, which the
    shard checks against its input_ids); the next chunks name only the request and
    their size (0 = the rest)."""
    import asyncio

    from router.shard_steps import ShardSteps
    from shard.pb_convert import new_request_from_pb
    from shard.step_checks import validate_request

    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=128,
                             max_batch_prefill_tokens=16, prefix_caching=False)
    scheduler = Scheduler(config, BlockManager(100, block_size=4, enable_prefix_caching=False))
    seq = make_seq(0, 24)
    scheduler.add(seq)
    while seq.status is not Status.RUNNING:
        prefill_all(scheduler)
    seq.output_ids.extend(range(100, 140))  # 64 tokens to recompute: 24 + 40
    scheduler._preempt(seq)

    class Client:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def restart_steps(self) -> None:
            pass

        async def prefill(self, request: Any) -> None:
            self.sent.append(request)

    async def recompute() -> list[Any]:
        client = Client()
        steps = ShardSteps(client=client)  # type: ignore[arg-type]
        while seq.status is not Status.RUNNING:
            chunks = scheduler.schedule_prefill()
            task, _ = steps.prefill(chunks)
            await task
            for chunk in chunks:
                scheduler.on_prefilled(chunk)
        return client.sent

    sent = asyncio.run(recompute())
    first = new_request_from_pb(sent[0].new_requests[0])
    validate_request(first, block_size=4, num_blocks=100, vocab_size=1000)
    assert (len(first.input_ids), first.num_generated, first.num_tokens) == (64, 40, 16)
    assert [len(step.new_requests) for step in sent] == [1, 0, 0, 0]
    counted = [(c.id, c.num_tokens) for step in sent[1:] for c in step.cached_requests]
    assert counted == [(0, 16), (0, 16), (0, 0)]

