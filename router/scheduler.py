"""Continuous-batching scheduler: admission, block reservation and preemption.

Pure logic, no I/O: the engine asks it which waiting sequences to prefill and which
blocks running sequences need before a decode step, and reports finished ones. It owns
the waiting queue and the running set; the block manager owns the blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.request import Sequence, Status


@dataclass
class DecodePlan:
    """Blocks to append before the next decode step, and sequences preempted for them.

    Attributes:
        block_appends: Sequence id → new block ids, appended to its block table.
        preempted: Sequences removed from the running batch and queued for recompute.
    """

    block_appends: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue (FIFO) and the running sequences (in admission order)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_requests(self) -> int:
        """Waiting plus running sequences."""
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule_prefill(self) -> list[Sequence]:
        """Admit waiting sequences, in order, within the prefill token budget, the batch
        size and the free blocks; allocate the blocks of their whole current sequence.

        Admission stops at the first sequence that does not fit, so the queue stays FIFO.
        """
        admitted: list[Sequence] = []
        budget = self.config.max_batch_prefill_tokens
        while self.waiting:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                seq.status = Status.FINISHED
                continue
            num_tokens = seq.num_tokens
            if num_tokens > budget and admitted:
                break
            if len(self.running) + len(admitted) >= self.config.max_batch_size:
                break
            needed = self.block_manager.blocks_for_tokens(num_tokens)
            # Keep one block per running sequence in reserve so decodes can proceed.
            reserve = len(self.running) + len(admitted)
            if not self.block_manager.can_allocate(needed + reserve):
                if self.running or admitted or not self.block_manager.can_allocate(needed):
                    break
            self.waiting.popleft()
            seq.block_ids = self.block_manager.allocate(needed)
            seq.status = Status.RUNNING
            admitted.append(seq)
            budget -= num_tokens
        self.running.extend(admitted)
        return admitted

    def plan_decode(self) -> DecodePlan:
        """Make sure every running sequence has blocks for one more token.

        When blocks run out, the most recently admitted sequences are preempted: their
        blocks are freed and they go back to the front of the queue, to be recomputed
        from prompt + output so far (same tokens, since sampling depends only on the
        seed and the step).
        """
        plan = DecodePlan()
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            needed = self.block_manager.blocks_for_tokens(seq.num_tokens) - len(seq.block_ids)
            if needed <= 0:
                index += 1
                continue
            if self.block_manager.can_allocate(needed):
                new_blocks = self.block_manager.allocate(needed)
                seq.block_ids.extend(new_blocks)
                plan.block_appends.setdefault(seq.id, []).extend(new_blocks)
                index += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            plan.block_appends.pop(victim.id, None)
        return plan

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def drain(self) -> list[Sequence]:
        """Remove every sequence (after a shard failure); return them."""
        sequences = [*self.running, *self.waiting]
        for seq in self.running:
            self._release(seq)
            seq.status = Status.FINISHED
        self.running.clear()
        self.waiting.clear()
        return sequences

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
