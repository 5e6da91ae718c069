"""What the shard remembers about each request between steps, keyed by request id
(the step contract in proto/shard.proto): host records (:class:`RequestState`) of every
request held, and for those that decode, the same rows as device tensors
(:class:`~shard.decode_state.DecodeRows`), kept in row order by every operation here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shard.decode_state import DecodeRows
from shard.grammar import GrammarMatcher
from shard.inputs import SeqChunk
from shard.records import CachedRequest
from shard.sampling import has_penalty, is_plain_greedy
from shard.sampling_types import SamplingParams


@dataclass
class RequestState:
    """One request the shard holds.

    Attributes:
        request_id: router-assigned id.
        block_table: KV block ids in order; grows with a step's ``new_block_ids``.
        token_ids: prompt + generated tokens; once decoding, ending with the last
            sampled token (whose K/V are not in the cache yet).
        seq_len: tokens whose K/V are in the cache (= len(token_ids) - 1 once
            decoding; fewer while its prompt is prefilled in chunks).
        num_generated: generated tokens (a suffix of token_ids).
        sampling: sampling parameters.
        top_n_tokens: alternatives to return per token.
        grammar: the grammar state of a constrained request (None = unconstrained).
        decoding: its prefill is complete: it is a decoding row.
        proposer_state: what a speculative proposer keeps for this request between
            steps (:class:`shard.speculative.Proposer`), or None.
    """

    request_id: int
    block_table: list[int]
    token_ids: list[int]
    seq_len: int
    num_generated: int
    sampling: SamplingParams
    top_n_tokens: int = 0
    grammar: GrammarMatcher | None = None
    decoding: bool = False
    proposer_state: object | None = None

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


class RequestTable:
    """Every request the shard holds, keyed by request id: those being prefilled in
    chunks (host state only) and the decoding rows (host and device state, in row
    order: the order they finished their prefill; a row that leaves keeps the others'
    order)."""

    def __init__(self) -> None:
        self._requests: dict[int, RequestState] = {}
        self.decoding: list[RequestState] = []
        self.rows: DecodeRows | None = None
        self._kind: BatchKind | None = None

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def get(self, request_id: int) -> RequestState:
        """Raises ValueError for an id not held."""
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"request {request_id} is not held by this shard") from None

    @property
    def kind(self) -> BatchKind:
        """The decoding rows' :class:`BatchKind`, computed once per membership."""
        if self._kind is None:
            self._kind = BatchKind.of(self.decoding)
        return self._kind

    def check_finished(self, request_ids: Iterable[int]) -> None:
        """Raises ValueError when an id is not held or repeats."""
        ids = list(request_ids)
        unknown = [rid for rid in ids if rid not in self._requests]
        if unknown:
            raise ValueError(
                f"finished_request_ids {sorted(unknown)[:5]} are not held by this shard")
        if len(set(ids)) != len(ids):
            raise ValueError("finished_request_ids repeat")

    def finish(self, request_ids: Iterable[int]) -> None:
        """Drop the listed requests (checked by :meth:`check_finished`); decoding rows
        that stay keep their order."""
        leaving = set(request_ids)
        if not leaving:
            return
        for rid in leaving:
            del self._requests[rid]
        kept = [i for i, r in enumerate(self.decoding) if r.request_id not in leaving]
        if len(kept) == len(self.decoding):
            return
        self.decoding = [self.decoding[i] for i in kept]
        self._kind = None
        assert self.rows is not None
        self.rows = self.rows.select(kept) if kept else None

    def add(self, state: RequestState) -> None:
        """Hold a new request (before its first chunk is computed)."""
        assert state.request_id not in self._requests, f"request {state.request_id} is held"
        self._requests[state.request_id] = state

    def join(self, states: Sequence[RequestState], tokens: torch.Tensor,
             device: torch.device) -> None:
        """Make held requests whose prefill is complete decoding rows, after the others.

        Args:
            states: the requests, in order; each already :meth:`add`-ed.
            tokens: [len(states)] int64 on ``device``, each one's first sampled token
                (read on the device by the next decode step).
        """
        new = DecodeRows.build(tokens, [s.seq_len for s in states],
                               [s.block_table for s in states], device)
        self.rows = new if self.rows is None else DecodeRows.concatenate([self.rows, new])
        self.decoding.extend(states)
        for state in states:
            state.decoding = True
        self._kind = None

    def next_chunks(self, cached: Sequence[CachedRequest]
                    ) -> tuple[list[RequestState], list[SeqChunk]]:
        """The next chunk of each held request being prefilled that ``cached`` names
        (``num_tokens`` 0: the rest of its prompt), recorded as computed: the requests
        and their chunks, in that order."""
        states, chunks = [], []
        for c in cached:
            state = self.get(c.request_id)
            end = len(state.token_ids) if c.num_tokens == 0 else state.seq_len + c.num_tokens
            chunks.append(SeqChunk(state.token_ids[state.seq_len:end], state.seq_len,
                                   state.block_table))
            state.seq_len = end
            states.append(state)
        return states, chunks

    def append_blocks(self, appends: Mapping[int, Sequence[int]]) -> None:
        """Append new block ids to the named requests' block tables (and to the device
        rows of the decoding ones). Checked beforehand by
        :func:`shard.step_checks.validate_appends`."""
        if not appends:
            return
        row_of = {r.request_id: i for i, r in enumerate(self.decoding)} if self.rows else {}
        row_appends = []
        for rid, blocks in appends.items():
            state = self._requests[rid]
            if rid in row_of:
                row_appends.append((row_of[rid], len(state.block_table), blocks))
            state.block_table.extend(blocks)
        if row_appends:
            assert self.rows is not None
            self.rows.append_blocks(row_appends)

    def clear(self) -> None:
        """Drop every request."""
        self._requests.clear()
        self.decoding = []
        self.rows = None
        self._kind = None
