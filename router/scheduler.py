"""Continuous-batching scheduler: the running batch and the step policies.

Pure logic, no I/O: the engine asks it for each iteration's work
(:meth:`Scheduler.schedule`: prompt chunks to prefill, running sequences to decode and
the blocks they need) and reports finished sequences. It owns the running batch and
decides when a step prefills, decodes or both, and whom to preempt; the parts it owns do
the rest:

- :mod:`router.prefill_queue`: the waiting and prefilling sequences, admission and
  chunking;
- :mod:`router.block_planner`: which KV blocks each sequence holds (reservation at
  admission, appends before a decode step, preemption, release) over the block manager,
  which owns the blocks and the prefix index;
- :mod:`router.scheduler_output`: the records it returns (:class:`PrefillChunk`,
  :class:`DecodePlan`, :class:`SchedulerOutput`; importable from here too).
"""

from __future__ import annotations

from collections import deque

from router import speculation
from router.block_manager import BlockManager
from router.block_planner import BlockPlanner
from router.config import SchedulerConfig
from router.prefill_budget import PrefillBudget
from router.prefill_queue import PrefillQueue
from router.request import Sequence, Status
from router.scheduler_output import DecodePlan, PrefillChunk, SchedulerOutput

__all__ = ["DecodePlan", "PrefillChunk", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the running sequences (in admission order), the queue of those not yet
    running (:attr:`waiting`, :attr:`prefilling`) and the planner of their blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = BlockPlanner(block_manager)
        self.queue = PrefillQueue(self.blocks)
        self.running: list[Sequence] = []
        self.steps_since_prefill = 0
        self._held_decodes = 0  # prefill steps in a row that held the running batch
        self.prefill_budget = PrefillBudget(config.itl_target_s)

    @property
    def block_manager(self) -> BlockManager:
        """The blocks and prefix index the planner draws on; assigning one (a restart's
        new cache, nothing admitted) replaces it."""
        return self.blocks.manager

    @block_manager.setter
    def block_manager(self, manager: BlockManager) -> None:
        self.blocks.manager = manager

    @property
    def waiting(self) -> deque[Sequence]:
        """Sequences waiting for admission, first in line first (the queue's)."""
        return self.queue.waiting

    @property
    def prefilling(self) -> list[Sequence]:
        """Admitted sequences whose prompt is being prefilled (the queue's)."""
        return self.queue.prefilling

    def schedule(self) -> SchedulerOutput:
        """This iteration's work: the running sequences that still need a token, with
        their new blocks, and prompt chunks within the prefill budget; the engine sends
        both as one mixed step (or whichever there is). The state is updated as if the
        work were sent (chunks recorded as prefilled, one more token in flight for each
        sequence sampled): the engine sends all of it.

        The running batch comes first (vLLM's order): it gets the blocks its next token
        needs, preempting the latest admitted when they run out, before newcomers are
        admitted into what is left; the chunks' budget is what fits the ITL target
        (:class:`~router.prefill_budget.PrefillBudget`) while requests decode. A
        sequence whose tokens in flight already reach its limit is not stepped (its
        last token is being computed). Without ``decode_during_prefill``:
        :meth:`schedule_prefill_first`.
        """
        if not self.config.decode_during_prefill:
            return self.schedule_prefill_first()
        decoding = [seq for seq in self.running if self._needs_step(seq)]
        plan = DecodePlan()
        # guesses only in a step that prefills nothing (a decode step, not a mixed one)
        guesses = {} if self.prefilling or (self.waiting and self._should_prefill()) else (
            speculation.lookahead(self.config, decoding))
        if decoding:
            decoding, plan = self._step_rows(decoding, guesses)
        if guesses:
            return SchedulerOutput([], decoding, plan.block_appends, plan.preempted,
                                   mixed=True, speculative={
                                       seq.id: guesses[seq.id] for seq in decoding})
        # NOTE: chunks never write blocks that a row of the same step was given: the
        # rows were served first, and a sequence preempted for them leaves the shards
        # before the step (it is not a row of it)
        chunks = self.schedule_prefill(self.prefill_budget.tokens(
            self.config.max_batch_prefill_tokens, decoding=bool(decoding)))
        self._send_chunks(chunks)
        return SchedulerOutput(chunks, decoding, plan.block_appends, plan.preempted, mixed=True)

    def schedule_prefill_first(self) -> SchedulerOutput:
        """:meth:`schedule` without mixed steps: prompt chunks within the prefill
        budget, then (in a second step) the running sequences.

        Policy (TGI's prefill-first): an iteration that prefills holds the running
        batch, up to ``max_waiting_tokens`` such iterations in a row (newcomers that
        finish at their prefill could otherwise hold it forever).
        """
        chunks = self.schedule_prefill()
        self._send_chunks(chunks)  # sent before the decode: a completed prompt decodes too
        decoding = [seq for seq in self.running if self._needs_step(seq)]
        if chunks and decoding and self._held_decodes < self.config.max_waiting_tokens:
            self._held_decodes += 1
            return SchedulerOutput(chunks)
        if not decoding:
            return SchedulerOutput(chunks)
        self._held_decodes = 0
        decoding, plan = self._step_rows(decoding)
        return SchedulerOutput(chunks, decoding, plan.block_appends, plan.preempted)

    def _send_chunks(self, chunks: list[PrefillChunk]) -> None:
        """Record ``chunks`` as sent: prefilled, and a completed prompt's first token in
        flight."""
        for chunk in chunks:
            self.on_prefilled(chunk)
            if not chunk.partial:
                chunk.seq.pending_tokens += 1  # its first token

    def _step_rows(self, decoding: list[Sequence], guesses: dict[int, int] | None = None
                   ) -> tuple[list[Sequence], DecodePlan]:
        """Blocks for a decode step of ``decoding`` (:meth:`plan_decode`); returns the
        rows still running, each with one more token in flight, and the plan."""
        plan = self.plan_decode(decoding, guesses)
        rows = [seq for seq in decoding if seq.status is Status.RUNNING]
        for seq in rows:
            seq.pending_tokens += 1
        return rows, plan

    def _needs_step(self, seq: Sequence) -> bool:
        """Whether ``seq`` still needs a decode step: not when the tokens in flight
        already reach its ``max_new_tokens`` or ``max_total_tokens`` (another step would
        compute a token that is always discarded)."""
        generated = len(seq.output_ids) + seq.pending_tokens
        return (
            generated < seq.request.stopping.max_new_tokens
            and len(seq.request.input_ids) + generated < self.config.max_total_tokens
        )

    @property
    def num_requests(self) -> int:
        """Waiting, prefilling and running sequences."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def cancelled(self) -> list[Sequence]:
        """Cancelled sequences still admitted: they leave at the next step, so they no
        longer count against ``max_concurrent_requests``."""
        return [seq for seq in (*self.running, *self.prefilling) if seq.cancelled]

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.queue.add(seq)

    def schedule_prefill(self, budget: int | None = None) -> list[PrefillChunk]:
        """Pick prompt tokens to prefill within ``budget`` (default
        ``max_batch_prefill_tokens``), when :meth:`_should_prefill`
        (:meth:`PrefillQueue.schedule`: continuing prompts first, then newcomers
        admitted in order while the batch size and the free blocks allow).
        """
        if not self._should_prefill():
            return []
        if budget is None:
            budget = self.config.max_batch_prefill_tokens
        chunks = self.queue.schedule(self.config, budget, num_running=len(self.running))
        if chunks:
            self.steps_since_prefill = 0
        return chunks

    def _should_prefill(self) -> bool:
        """TGI's policy: with a batch running, admit newcomers once enough are waiting
        (``waiting_served_ratio``) or the batch has decoded ``max_waiting_tokens`` steps;
        a prompt already being prefilled in chunks always continues."""
        if not self.running or self.prefilling:
            return True
        config = self.config
        return (
            len(self.waiting) >= config.waiting_served_ratio * len(self.running)
            or self.steps_since_prefill >= config.max_waiting_tokens
        )

    def on_prefilled(self, chunk: PrefillChunk) -> None:
        """Record that ``chunk`` was computed: index its full blocks in the prefix cache;
        a sequence whose prompt is complete joins the running batch."""
        seq = chunk.seq
        seq.num_computed = chunk.end
        self.blocks.register(seq, chunk.end)
        if not chunk.partial and seq in self.prefilling:
            self.queue.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def plan_decode(self, decoding: list[Sequence] | None = None,
                    guesses: dict[int, int] | None = None) -> DecodePlan:
        """Make sure every running sequence in ``decoding`` (default: all) has blocks
        for one more token beyond those in flight (``pending_tokens``), and for its
        ``guesses`` (sequence id → guesses of a speculative step) beyond that.

        When blocks run out, the most recently admitted sequences are preempted
        (:meth:`BlockPlanner.plan_decode`): their blocks are freed and they go back to
        the front of the queue, to be recomputed from prompt + output so far (same
        tokens, since sampling depends only on the seed and the step).
        """
        self.steps_since_prefill += 1
        stepping = None if decoding is None else {seq.id for seq in decoding}
        plan = self.blocks.plan_decode(self.running, stepping, guesses or {})
        for seq in plan.preempted:
            self._preempt(seq)
        return plan

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.queue.remove(seq)
        if seq.status is Status.RUNNING:
            # NOTE: its answer joins the prefix cache too (a chat's next turn repeats it):
            # the K/V of every token but the last sampled one are computed.
            self.blocks.register(seq, seq.num_tokens - 1)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def drain(self, include_waiting: bool = True) -> list[Sequence]:
        """Remove the admitted sequences (after a shard failure), and the waiting ones
        too unless ``include_waiting`` is False; return them."""
        sequences = [*self.running, *self.queue.take(include_waiting)]
        self.running.clear()
        for seq in sequences:
            self.blocks.release(seq)
            seq.status = Status.FINISHED
        return sequences

    def _preempt(self, seq: Sequence) -> None:
        """Take running ``seq`` out, its blocks freed (if they are not yet), and queue it
        first for recompute."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.epoch += 1  # its tokens in flight are discarded; it is recomputed instead
        seq.pending_tokens = 0
        self.queue.requeue(seq)
