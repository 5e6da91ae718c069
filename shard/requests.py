"""Shard-side batch state: what the shard remembers about each running request
between RPCs, keyed by batch id: host records (:class:`RequestState`) and, for the
decode step, the same rows as device tensors (:class:`~shard.decode_state.DecodeRows`),
kept in the same order by every operation here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shard.decode_state import DecodeRows
from shard.errors import UnknownBatchError
from shard.grammar import GrammarMatcher
from shard.sampling import has_penalty, is_plain_greedy
from shard.sampling_types import SamplingParams


@dataclass
class RequestState:
    """One running request.

    Attributes:
        request_id: router-assigned id.
        block_table: KV block ids in order; grows with ``BlockAppend``.
        token_ids: prompt + generated tokens, ending with the last sampled token
            (whose K/V are not in the cache yet).
        seq_len: tokens whose K/V are in the cache (= len(token_ids) - 1).
        num_generated: generated tokens (a suffix of token_ids).
        sampling: sampling parameters.
        top_n_tokens: alternatives to return per token.
        grammar: the grammar state of a constrained request (None = unconstrained).
    """

    request_id: int
    block_table: list[int]
    token_ids: list[int]
    seq_len: int
    num_generated: int
    sampling: SamplingParams
    top_n_tokens: int = 0
    grammar: GrammarMatcher | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy, no penalties, no alternatives: the sampler's fast path applies."""
        return self.top_n_tokens == 0 and is_plain_greedy(self.sampling)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def generated_tokens(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_generated :]

    def append_token(self, token_id: int) -> None:
        """Record a decode step: the previous last token is now cached, token_id is new."""
        self.advance()
        self.record_token(token_id)

    def advance(self) -> None:
        """The first half of :meth:`append_token`, done when a step is launched: one
        more token cached and one more generated (its id is not known yet)."""
        self.seq_len += 1
        self.num_generated += 1

    def record_token(self, token_id: int) -> None:
        """The second half, done when the step's result is read: the new token's id
        (which also advances the grammar state)."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


@dataclass(frozen=True)
class BatchKind:
    """What a decode step must do beyond the argmax, over a whole batch.

    Attributes:
        plain_greedy: every request is :attr:`RequestState.plain_greedy` (the sampler's
            fast path).
        has_grammar: some request is constrained by a grammar.
        has_penalty: some request has a repetition, frequency or presence penalty.
    """

    plain_greedy: bool
    has_grammar: bool
    has_penalty: bool

    @staticmethod
    def of(requests: Sequence[RequestState]) -> BatchKind:
        return BatchKind(
            plain_greedy=all(r.plain_greedy for r in requests),
            has_grammar=any(r.grammar is not None for r in requests),
            has_penalty=any(has_penalty(r.sampling) for r in requests),
        )


@dataclass
class CachedBatch:
    """The shard's state of a cached batch (the router's ``pb.CachedBatch`` names it by
    id and request ids): requests kept under one batch id, in order, between steps.

    Attributes:
        batch_id: router-assigned id.
        requests: host state of each request.
        rows: the same requests' device state, row ``i`` for ``requests[i]``.
    """

    batch_id: int
    requests: list[RequestState]
    rows: DecodeRows
    _kind: BatchKind | None = field(default=None, repr=False, compare=False)

    @property
    def request_ids(self) -> tuple[int, ...]:
        return tuple(r.request_id for r in self.requests)

    @property
    def kind(self) -> BatchKind:
        """The requests' :class:`BatchKind`, computed once per membership (each step
        reads it; concatenating and filtering change it)."""
        if self._kind is None:
            self._kind = BatchKind.of(self.requests)
        return self._kind

    def set_requests(self, requests: list[RequestState]) -> None:
        """Replace the membership (the rows are the caller's to keep in step)."""
        self.requests = requests
        self._kind = None


class BatchStore:
    """All batches held by the shard, keyed by batch id."""

    def __init__(self) -> None:
        self._batches: dict[int, CachedBatch] = {}

    def __len__(self) -> int:
        return len(self._batches)

    def __contains__(self, batch_id: int) -> bool:
        return batch_id in self._batches

    def add(self, batch: CachedBatch) -> None:
        """Keep ``batch``. Raises ValueError when its id is already held."""
        if batch.batch_id in self._batches:
            raise ValueError(
                f"batch id {batch.batch_id} is already cached; clear or filter it first"
            )
        self._batches[batch.batch_id] = batch

    def get(self, batch_id: int) -> CachedBatch:
        """Raises UnknownBatchError."""
        try:
            return self._batches[batch_id]
        except KeyError:
            raise UnknownBatchError(batch_id) from None

    def check_concatenate(self, batch_ids: Sequence[int]) -> None:
        """Validate :meth:`concatenate` arguments without changing anything.

        Raises:
            ValueError: no ids, a repeated id, or a request id in two batches.
            UnknownBatchError: an id not held.
        """
        if not batch_ids:
            raise ValueError("batches must not be empty")
        if len(batch_ids) == 1:  # every decode step of a settled batch: nothing to merge
            self.get(batch_ids[0])
            return
        if len(set(batch_ids)) != len(batch_ids):
            raise ValueError(f"batch ids repeat: {list(batch_ids)}")
        seen: set[int] = set()
        for batch_id in batch_ids:
            for rid in self.get(batch_id).request_ids:
                if rid in seen:
                    raise ValueError(f"request id {rid} appears in more than one batch")
                seen.add(rid)

    def concatenate(self, batch_ids: Sequence[int]) -> CachedBatch:
        """Merge batches, in order, into one kept under the first id; the others are dropped.

        Raises: as :meth:`check_concatenate`.
        """
        self.check_concatenate(batch_ids)
        first = self._batches[batch_ids[0]]
        if len(batch_ids) == 1:
            return first
        requests, rows = list(first.requests), [first.rows]
        for batch_id in batch_ids[1:]:
            other = self._batches.pop(batch_id)
            requests.extend(other.requests)
            rows.append(other.rows)
        first.set_requests(requests)
        first.rows = DecodeRows.concatenate(rows)
        return first

    def filter(self, batch_id: int, keep: Iterable[int]) -> CachedBatch:
        """Keep only the listed request ids (in the batch's order); an empty result
        drops the batch.

        Raises:
            UnknownBatchError: unknown batch id.
            ValueError: a listed id is not in the batch.
        """
        batch = self.get(batch_id)
        keep_set = set(keep)
        unknown = keep_set - set(batch.request_ids)
        if unknown:
            raise ValueError(f"request ids {sorted(unknown)} are not in batch {batch_id}")
        kept = [i for i, r in enumerate(batch.requests) if r.request_id in keep_set]
        batch.set_requests([batch.requests[i] for i in kept])
        if batch.requests:
            batch.rows = batch.rows.select(kept)
        else:
            del self._batches[batch_id]
        return batch

    def clear(self, batch_id: int | None = None) -> None:
        """Drop one batch or, with None, all of them. Idempotent: an id not held (e.g.
        already dropped by filtering it to nothing) is ignored."""
        if batch_id is None:
            self._batches.clear()
        else:
            self._batches.pop(batch_id, None)
