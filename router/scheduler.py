"""Continuous-batching scheduler: admission, chunked prefill, block reservation and
preemption.

Pure logic, no I/O: the engine asks it which prompt tokens to prefill this step and
which blocks running sequences need before a decode step, and reports finished ones. It
owns the waiting queue, the sequences being prefilled in chunks and the running set;
the block manager owns the blocks and the prefix index.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from router import speculation
from router.block_manager import BlockManager, block_hashes
from router.config import SchedulerConfig
from router.prefill_budget import PrefillBudget
from router.request import Sequence, Status


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``all_ids()[cache_len:end]`` of ``seq`` to compute in this step.

    ``end < seq.num_tokens`` marks an intermediate chunk: K/V are written, nothing is
    sampled and the sequence keeps prefilling next step.

    ``block_ids`` is the sequence's block table when the chunk was scheduled: the Prefill
    goes out as scheduled even when the decode planned in the same iteration preempts the
    sequence (its blocks freed); the shards compute the chunk, the sequence leaves them
    with the Decode and the chunk's token is discarded: ``epoch`` is the sequence's epoch
    when the chunk was scheduled, which a preemption moves on (a token applies only in
    the epoch it was sampled for, even once the sequence runs again).
    """

    seq: Sequence
    cache_len: int
    end: int
    block_ids: tuple[int, ...]
    epoch: int

    @property
    def partial(self) -> bool:
        return self.end < self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this chunk."""
        return self.end - self.cache_len


@dataclass
class DecodePlan:
    """Blocks to append before the next decode step, and sequences preempted for them.

    Attributes:
        block_appends: Sequence id → new block ids, appended to its block table.
        preempted: Sequences removed from the running batch and queued for recompute.
    """

    block_appends: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one engine iteration sends: a prefill of ``chunks`` and a decode of
    ``decoding`` after appending ``block_appends``, in one mixed step or one after the
    other (``mixed``), or whichever there is.

    Attributes:
        chunks: Prompt chunks to prefill, continuing ones first.
        decoding: Running sequences to step by one token, in admission order.
        block_appends: Sequence id → new block ids, appended before the decode step.
        preempted: Sequences that lost their blocks to make room (queued again).
        mixed: ``decoding`` are the sequences that were running before ``chunks``,
            stepped in the same forward (one mixed step); False: a decode step after the
            prefill, which the sequences whose prompt it completes join.
        speculative: Sequence id → most guesses it verifies (a speculative decode
            step, :mod:`router.speculation`; no chunks then); empty: one token each.
    """

    chunks: list[PrefillChunk] = field(default_factory=list)
    decoding: list[Sequence] = field(default_factory=list)
    block_appends: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    mixed: bool = False
    speculative: dict[int, int] = field(default_factory=dict)


class Scheduler:
    """Owns the waiting queue (FIFO), the prefilling sequences and the running ones
    (in admission order)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.steps_since_prefill = 0
        self._held_decodes = 0  # prefill steps in a row that held the running batch
        self.prefill_budget = PrefillBudget(config.itl_target_s)

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
            plan = self.plan_decode(decoding, guesses)
            decoding = [seq for seq in decoding if seq.status is Status.RUNNING]
            for seq in decoding:
                seq.pending_tokens += 1
        if guesses:
            return SchedulerOutput([], decoding, plan.block_appends, plan.preempted,
                                   mixed=True, speculative={
                                       seq.id: guesses[seq.id] for seq in decoding})
        # NOTE: chunks never write blocks that a row of the same step was given: the
        # rows were served first, and a sequence preempted for them leaves the shards
        # before the step (it is not a row of it)
        chunks = self.schedule_prefill(self.prefill_budget.tokens(
            self.config.max_batch_prefill_tokens, decoding=bool(decoding)))
        for chunk in chunks:
            self.on_prefilled(chunk)
            if not chunk.partial:
                chunk.seq.pending_tokens += 1  # its first token
        return SchedulerOutput(chunks, decoding, plan.block_appends, plan.preempted, mixed=True)

    def schedule_prefill_first(self) -> SchedulerOutput:
        """:meth:`schedule` without mixed steps: prompt chunks within the prefill
        budget, then (in a second step) the running sequences.

        Policy (TGI's prefill-first): an iteration that prefills holds the running
        batch, up to ``max_waiting_tokens`` such iterations in a row (newcomers that
        finish at their prefill could otherwise hold it forever).
        """
        chunks = self.schedule_prefill()
        for chunk in chunks:  # sent before the decode: a completed prompt decodes too
            self.on_prefilled(chunk)
            if not chunk.partial:
                chunk.seq.pending_tokens += 1  # its first token
        decoding = [seq for seq in self.running if self._needs_step(seq)]
        if chunks and decoding and self._held_decodes < self.config.max_waiting_tokens:
            self._held_decodes += 1
            return SchedulerOutput(chunks)
        if not decoding:
            return SchedulerOutput(chunks)
        self._held_decodes = 0
        plan = self.plan_decode(decoding)
        decoding = [seq for seq in decoding if seq.status is Status.RUNNING]
        for seq in decoding:
            seq.pending_tokens += 1
        return SchedulerOutput(chunks, decoding, plan.block_appends, plan.preempted)

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
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule_prefill(self, budget: int | None = None) -> list[PrefillChunk]:
        """Pick prompt tokens to prefill within ``budget`` (default
        ``max_batch_prefill_tokens``).

        Sequences already being prefilled continue first; then waiting sequences are
        admitted in order while the batch size and the free blocks allow. An admitted
        sequence reuses its longest cached prefix and gets blocks for all its tokens.
        With chunked prefill a prompt larger than the remaining budget is split;
        without it, such a prompt waits for an otherwise empty prefill step.
        """
        chunks: list[PrefillChunk] = []
        if not self._should_prefill():
            return chunks
        if budget is None:
            budget = self.config.max_batch_prefill_tokens
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].num_tokens
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # An unsplittable prompt larger than what is left waits for a step of its own
            # (alone it may use the whole budget: prompts are at most max_input_tokens).
            if chunks and not self._splittable(seq) and seq.num_tokens > budget:
                break
            if not self._admit(seq, reserve=len(self.running) + len(self.prefilling)):
                break
            self.waiting.popleft()
            self.prefilling.append(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].num_tokens
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

    def _admit(self, seq: Sequence, reserve: int) -> bool:
        """Give ``seq`` its cached prefix and blocks for all its tokens, if they fit.

        ``reserve`` blocks (one per sequence already admitted) stay free so running
        sequences can keep decoding; an otherwise idle scheduler admits without it.
        """
        if len(self.running) + len(self.prefilling) >= self.config.max_batch_size:
            return False
        manager = self.block_manager
        # Prompt logprobs need every prompt position computed: no prefix reuse.
        # At least one token is left to compute (its logits are sampled).
        reusable = self._hashes(seq)[: (seq.num_tokens - 1) // manager.block_size]
        cached = [] if seq.wants_prompt_logprobs else manager.match_prefix(reusable)
        needed = manager.blocks_for_tokens(seq.num_tokens) - len(cached)
        cached_unowned = sum(1 for block in cached if manager.ref_count(block) == 0)
        if not manager.can_allocate(needed + cached_unowned + reserve) and (
            reserve or not manager.can_allocate(needed + cached_unowned)
        ):
            return False
        manager.share(cached)
        seq.block_ids = cached + manager.allocate(
            needed, after=cached[-1] if cached else None, lookahead=self._growth_blocks(seq)
        )
        seq.num_computed = len(cached) * manager.block_size
        manager.hit_tokens += seq.num_computed
        seq.status = Status.PREFILLING
        return True

    # NOTE: blocks reserved after a new table at most (see BlockManager.allocate): the
    # reservation is a locality hint that costs one dict move per block at admission.
    _MAX_LOOKAHEAD_BLOCKS = 128

    def _growth_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` will append if it generates all its remaining tokens (within
        ``max_total_tokens``), at most ``_MAX_LOOKAHEAD_BLOCKS``."""
        manager = self.block_manager
        remaining = seq.request.stopping.max_new_tokens - len(seq.output_ids)
        final = min(seq.num_tokens + max(remaining, 0), self.config.max_total_tokens)
        growth = manager.blocks_for_tokens(final) - manager.blocks_for_tokens(seq.num_tokens)
        return min(max(growth, 0), self._MAX_LOOKAHEAD_BLOCKS)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Block digests of ``seq``'s full blocks, extended to its current length."""
        if len(seq.block_hashes) < seq.num_tokens // self.block_manager.block_size:
            seq.block_hashes = block_hashes(
                seq.all_ids(), self.block_manager.block_size, seq.block_hashes
            )
        return seq.block_hashes

    def _splittable(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prefill may be split into chunks: with chunked prefill on, or
        always for a recompute after preemption (prompt + output can exceed the budget
        even when every prompt fits); never while prompt logprobs are wanted (they come
        back only from a whole-prompt prefill)."""
        if seq.wants_prompt_logprobs:
            return False
        return self.config.chunked_prefill or bool(seq.output_ids)

    def _chunk(self, seq: Sequence, budget: int) -> PrefillChunk:
        remaining = seq.num_tokens - seq.num_computed
        size = min(remaining, budget) if self._splittable(seq) else remaining
        return PrefillChunk(seq, seq.num_computed, seq.num_computed + size,
                            tuple(seq.block_ids), seq.epoch)

    def on_prefilled(self, chunk: PrefillChunk) -> None:
        """Record that ``chunk`` was computed: index its full blocks in the prefix cache;
        a sequence whose prompt is complete joins the running batch."""
        seq = chunk.seq
        seq.num_computed = chunk.end
        computed = self._hashes(seq)[: chunk.end // self.block_manager.block_size]
        self.block_manager.register(computed, seq.block_ids)
        if not chunk.partial and seq in self.prefilling:
            self.prefilling.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def plan_decode(self, decoding: list[Sequence] | None = None,
                    guesses: dict[int, int] | None = None) -> DecodePlan:
        """Make sure every running sequence in ``decoding`` (default: all) has blocks
        for one more token beyond those in flight (``pending_tokens``), and for its
        ``guesses`` (sequence id → guesses of a speculative step) beyond that.

        When blocks run out, the most recently admitted sequences are preempted: their
        blocks are freed and they go back to the front of the queue, to be recomputed
        from prompt + output so far (same tokens, since sampling depends only on the
        seed and the step).
        """
        plan = DecodePlan()
        self.steps_since_prefill += 1
        stepping = None if decoding is None else {seq.id for seq in decoding}
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            tokens = seq.num_tokens + seq.pending_tokens + (guesses or {}).get(seq.id, 0)
            needed = self.block_manager.blocks_for_tokens(tokens) - len(seq.block_ids)
            if needed <= 0 or (stepping is not None and seq.id not in stepping):
                index += 1
                continue
            if self.block_manager.can_allocate(needed):
                new_blocks = self.block_manager.allocate(
                    needed, after=seq.block_ids[-1] if seq.block_ids else None
                )
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
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.status is Status.RUNNING:
            # NOTE: its answer joins the prefix cache too (a chat's next turn repeats it):
            # the K/V of every token but the last sampled one are computed.
            size = self.block_manager.block_size
            self.block_manager.register(self._hashes(seq)[: (seq.num_tokens - 1) // size],
                                        seq.block_ids)
        self._release(seq)
        seq.status = Status.FINISHED

    def drain(self, include_waiting: bool = True) -> list[Sequence]:
        """Remove the admitted sequences (after a shard failure), and the waiting ones
        too unless ``include_waiting`` is False; return them."""
        sequences = [*self.running, *self.prefilling]
        if include_waiting:
            sequences += self.waiting
            self.waiting.clear()
        for seq in sequences:
            self._release(seq)
            seq.status = Status.FINISHED
        self.running.clear()
        self.prefilling.clear()
        return sequences

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.epoch += 1  # its tokens in flight are discarded; it is recomputed instead
        seq.pending_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.block_manager.release_reservation(seq.block_ids[-1])
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        seq.num_computed = 0
