"""Scheduler admission, block reservation and preemption (no shards involved)."""

from __future__ import annotations

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.request import GenerationRequest, SamplingParams, Sequence, Status, StoppingParams
from router.scheduler import Scheduler


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    request = GenerationRequest(
        input_ids=tuple(range(1, prompt_len + 1)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=64),
    )
    return Sequence(id=seq_id, request=request)


def make_scheduler(num_blocks: int, **budgets: int) -> Scheduler:
    prefill = budgets.pop("prefill", 64)
    config = SchedulerConfig(max_input_tokens=min(prefill, 64), max_total_tokens=128,
                             max_batch_prefill_tokens=prefill, **budgets)
    return Scheduler(config, BlockManager(num_blocks, block_size=4))


def test_admission_respects_prefill_budget_and_is_fifo() -> None:
    scheduler = make_scheduler(100, prefill=20)
    seqs = [make_seq(i, 8) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule_prefill() == seqs[:2]
    assert [len(s.block_ids) for s in seqs[:2]] == [2, 2]
    assert scheduler.schedule_prefill() == seqs[2:]


def test_blocks_allocated_on_demand() -> None:
    scheduler = make_scheduler(100)
    seq = make_seq(0, 4)
    scheduler.add(seq)
    scheduler.schedule_prefill()
    assert len(seq.block_ids) == 1
    seq.output_ids.append(7)  # 5 tokens: the new one needs a second block
    plan = scheduler.plan_decode()
    assert plan.block_appends == {0: seq.block_ids[1:]} and len(seq.block_ids) == 2
    assert scheduler.plan_decode().block_appends == {}


def test_newest_is_preempted_when_blocks_run_out() -> None:
    scheduler = make_scheduler(4)
    old, new = make_seq(0, 8), make_seq(1, 4)
    scheduler.add(old)
    scheduler.schedule_prefill()
    scheduler.add(new)
    assert scheduler.schedule_prefill() == [new]
    assert scheduler.block_manager.num_free == 1
    old.output_ids.append(1)  # 9 tokens: needs a third block
    new.output_ids.extend([1, 2])  # 6 tokens: needs a second block
    plan = scheduler.plan_decode()
    assert plan.preempted == [new] and new.status is Status.WAITING
    assert scheduler.waiting[0] is new and new.block_ids == []
    assert plan.block_appends == {0: old.block_ids[2:]}
    scheduler.finish(old)
    assert scheduler.schedule_prefill() == [new]
    assert len(new.block_ids) == 2  # recomputes prompt + output (6 tokens)
    scheduler.finish(new)
    scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_free == 4
