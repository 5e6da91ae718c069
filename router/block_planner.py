"""Which KV blocks each sequence holds: the scheduler's KV side.

:class:`BlockPlanner` turns the scheduler's decisions into block tables over a
:class:`~router.block_manager.BlockManager`: an admitted sequence gets its longest cached
prefix and blocks for all its tokens (with room reserved for its growth); before a
decode step each running sequence gets the blocks its next tokens need, the latest
admitted losing theirs when the pool runs out; computed blocks are indexed in the prefix
cache; a sequence that leaves gives its blocks back. The queues (waiting, prefilling,
running) and the step policies stay with :class:`~router.scheduler.Scheduler`, which
owns one planner: a preempted sequence comes back in :attr:`DecodePlan.preempted` with
its blocks freed, and the scheduler queues it for recompute.
"""

from __future__ import annotations

from router.block_manager import BlockManager, block_hashes
from router.request import Sequence
from router.scheduler_output import DecodePlan

# NOTE: blocks reserved after a new table at most (see BlockManager.allocate): the
# reservation is a locality hint that costs one dict move per block at admission.
MAX_LOOKAHEAD_BLOCKS = 128


class BlockPlanner:
    """Block tables of the scheduler's sequences, over ``manager`` (which the engine
    replaces after a restart: assign :attr:`manager`)."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def admit(self, seq: Sequence, reserve: int, max_total_tokens: int) -> bool:
        """Give ``seq`` its cached prefix and blocks for all its tokens, if they fit;
        False (nothing changed) if not.

        ``reserve`` blocks (one per sequence already admitted) stay free so running
        sequences can keep decoding; with ``reserve`` 0 (an otherwise idle scheduler) the
        blocks only have to fit. Sets ``seq.block_ids`` and ``seq.num_computed`` (tokens
        of the cached prefix) and counts them in ``manager.hit_tokens``; blocks after the
        table are reserved for the tokens it may generate within ``max_total_tokens``.
        """
        manager = self.manager
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
        lookahead = self._growth_blocks(seq, max_total_tokens)
        seq.block_ids = cached + manager.allocate(
            needed, after=cached[-1] if cached else None, lookahead=lookahead
        )
        seq.num_computed = len(cached) * manager.block_size
        manager.hit_tokens += seq.num_computed
        return True

    def _growth_blocks(self, seq: Sequence, max_total_tokens: int) -> int:
        """Blocks ``seq`` will append if it generates all its remaining tokens (within
        ``max_total_tokens``), at most ``MAX_LOOKAHEAD_BLOCKS``."""
        manager = self.manager
        remaining = seq.request.stopping.max_new_tokens - len(seq.output_ids)
        final = min(seq.num_tokens + max(remaining, 0), max_total_tokens)
        growth = manager.blocks_for_tokens(final) - manager.blocks_for_tokens(seq.num_tokens)
        return min(max(growth, 0), MAX_LOOKAHEAD_BLOCKS)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Block digests of ``seq``'s full blocks, extended to its current length."""
        if len(seq.block_hashes) < seq.num_tokens // self.manager.block_size:
            seq.block_hashes = block_hashes(seq.all_ids(), self.manager.block_size,
                                            seq.block_hashes)
        return seq.block_hashes

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """Index in the prefix cache the full blocks of ``seq``'s first ``num_tokens``
        tokens (their K/V computed)."""
        computed = self._hashes(seq)[: num_tokens // self.manager.block_size]
        self.manager.register(computed, seq.block_ids)

    def plan_decode(self, running: list[Sequence], stepping: set[int] | None,
                    guesses: dict[int, int]) -> DecodePlan:
        """Make sure every sequence of ``running`` whose id is in ``stepping`` (None:
        all) has blocks for one more token beyond those in flight (``pending_tokens``),
        and for its ``guesses`` (sequence id → guesses of a speculative step) beyond that.

        When blocks run out, the last of ``running`` (the most recently admitted) is
        preempted: its blocks are freed and it is listed in ``preempted``, in the order
        taken, then the next last, until the blocks fit. ``running`` itself is left as
        it is: the caller queues the preempted sequences for recompute.
        """
        plan = DecodePlan()
        candidates = list(running)
        index = 0
        while index < len(candidates):
            seq = candidates[index]
            tokens = seq.num_tokens + seq.pending_tokens + guesses.get(seq.id, 0)
            needed = self.manager.blocks_for_tokens(tokens) - len(seq.block_ids)
            if needed <= 0 or (stepping is not None and seq.id not in stepping):
                index += 1
                continue
            if self.manager.can_allocate(needed):
                new_blocks = self.manager.allocate(
                    needed, after=seq.block_ids[-1] if seq.block_ids else None
                )
                seq.block_ids.extend(new_blocks)
                plan.block_appends.setdefault(seq.id, []).extend(new_blocks)
                index += 1
                continue
            victim = candidates.pop()
            self.release(victim)
            plan.preempted.append(victim)
            plan.block_appends.pop(victim.id, None)
        return plan

    def release(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks and their reservation; nothing of it is computed
        any more. Releasing a sequence without blocks changes nothing but that."""
        if seq.block_ids:
            self.manager.release_reservation(seq.block_ids[-1])
            self.manager.free(seq.block_ids)
            seq.block_ids = []
        seq.num_computed = 0
