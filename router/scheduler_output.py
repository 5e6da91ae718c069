"""What the scheduler decides for one engine iteration, as plain records.

:class:`PrefillChunk` (prompt tokens of one sequence to compute), :class:`DecodePlan`
(blocks appended before a decode step, sequences preempted for them) and
:class:`SchedulerOutput` (one iteration's chunks and decoding rows) are data only: the
scheduler (:mod:`router.scheduler`) and the block planner (:mod:`router.block_planner`)
build them, the engine and :mod:`router.shard_steps` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.request import Sequence


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
