"""The sequences not yet running, and which of their prompt tokens a prefill step
computes: admission and chunking.

:class:`PrefillQueue` holds the waiting queue (FIFO) and the admitted sequences whose
prompt is being prefilled. Each prefill step continues the prompts being prefilled
first, then admits waiting sequences in order while the batch size, the blocks
(:meth:`~router.block_planner.BlockPlanner.admit`) and the step's token budget allow,
splitting a prompt into chunks where that is allowed. Whether a step prefills at all
(TGI's ``waiting_served_ratio``, mixed steps) and moving a complete prompt into the
running batch are the scheduler's (:mod:`router.scheduler`), which owns one queue.
"""

from __future__ import annotations

from collections import deque

from router.block_planner import BlockPlanner
from router.config import SchedulerConfig
from router.request import Sequence, Status
from router.scheduler_output import PrefillChunk


class PrefillQueue:
    """Waiting sequences (FIFO) and prefilling ones (in admission order), given blocks
    by ``blocks``."""

    def __init__(self, blocks: BlockPlanner) -> None:
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence last."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Queue a preempted sequence first (it is recomputed before newcomers)."""
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever of the two it is in, if any."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def take(self, include_waiting: bool) -> list[Sequence]:
        """Empty the prefilling sequences, and the waiting ones if ``include_waiting``;
        return them in that order."""
        sequences = list(self.prefilling)
        self.prefilling.clear()
        if include_waiting:
            sequences += self.waiting
            self.waiting.clear()
        return sequences

    def schedule(self, config: SchedulerConfig, budget: int, num_running: int
                 ) -> list[PrefillChunk]:
        """Prompt chunks of at most ``budget`` tokens in all, continuing ones first.

        Waiting sequences are admitted in order while fewer than ``max_batch_size`` are
        running (``num_running``) or prefilling and their blocks fit. An admitted
        sequence reuses its longest cached prefix and gets blocks for all its tokens.
        A prompt larger than the remaining budget is split where :meth:`_splittable`
        allows; otherwise it waits for an otherwise empty prefill step.
        """
        chunks: list[PrefillChunk] = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunks.append(self._chunk(config, seq, budget))
            budget -= chunks[-1].num_tokens
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # An unsplittable prompt larger than what is left waits for a step of its own
            # (alone it may use the whole budget: prompts are at most max_input_tokens).
            if chunks and not self._splittable(config, seq) and seq.num_tokens > budget:
                break
            if not self._admit(config, seq, admitted=num_running + len(self.prefilling)):
                break
            self.waiting.popleft()
            self.prefilling.append(seq)
            chunks.append(self._chunk(config, seq, budget))
            budget -= chunks[-1].num_tokens
        return chunks

    def _admit(self, config: SchedulerConfig, seq: Sequence, admitted: int) -> bool:
        """Admit ``seq`` within ``max_batch_size`` if its blocks fit with one block per
        sequence already ``admitted`` left free (:meth:`BlockPlanner.admit`)."""
        if admitted >= config.max_batch_size:
            return False
        if not self.blocks.admit(seq, reserve=admitted,
                                 max_total_tokens=config.max_total_tokens):
            return False
        seq.status = Status.PREFILLING
        return True

    @staticmethod
    def _splittable(config: SchedulerConfig, seq: Sequence) -> bool:
        """Whether ``seq``'s prefill may be split into chunks: with chunked prefill on, or
        always for a recompute after preemption (prompt + output can exceed the budget
        even when every prompt fits); never while prompt logprobs are wanted (they come
        back only from a whole-prompt prefill)."""
        if seq.wants_prompt_logprobs:
            return False
        return config.chunked_prefill or bool(seq.output_ids)

    def _chunk(self, config: SchedulerConfig, seq: Sequence, budget: int) -> PrefillChunk:
        remaining = seq.num_tokens - seq.num_computed
        size = min(remaining, budget) if self._splittable(config, seq) else remaining
        return PrefillChunk(seq, seq.num_computed, seq.num_computed + size,
                            tuple(seq.block_ids), seq.epoch)
