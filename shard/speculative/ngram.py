"""Prompt lookup (n-gram) proposals: guess that a row continues the way it continued
the last time its latest tokens appeared in its own prompt or output.

Saxena 2023, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding);
the same proposer as vLLM's ``ngram`` method: for n from ``n_max`` down to ``n_min``,
find the latest earlier occurrence of the row's last n tokens and propose the tokens
that followed it. No model runs; input-grounded tasks (summarize, extract, edit, code
with repeated identifiers) copy long runs of their input, which this guesses well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shard.requests import RequestState

# NOTE: below this many new n-grams a plain loop is cheaper than the zip of shifted
# slices (whose set-up costs a few microseconds per table)
_BULK = 16


def propose_ngram(token_ids: Sequence[int], num_tokens: int, n_min: int, n_max: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the last n tokens of
    ``token_ids``, for the largest n in [n_min, n_max] that has one (brute force, no
    state: the reference of :class:`NgramProposer`).

    An occurrence is earlier when it starts before the suffix itself (it may overlap
    it). ``num_tokens`` ids, or [] when no n matches or ``num_tokens`` is 0: when the
    tokens after the occurrence run into the row's end, the guesses go on as if the row
    repeated itself with that period (:func:`follow`).
    """
    length = len(token_ids)
    if num_tokens <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = list(token_ids[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(token_ids[start : start + n]) == suffix:
                return follow(token_ids, start + n, num_tokens)
    return []


def follow(token_ids: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """``num_tokens`` guesses copied from ``token_ids[start:]``; past the end the copy
    reads its own guesses (an overlapping copy, as in LZ77): the row continues with
    period ``len(token_ids) - start``, so a run of one token gives ``num_tokens``
    guesses of it rather than one."""
    guesses = list(token_ids[start : start + num_tokens])
    period = len(token_ids) - start
    while len(guesses) < num_tokens:
        guesses.append(guesses[len(guesses) - period])
    return guesses


@dataclass
class _NgramIndex:
    """A request's n-grams, extended with the tokens appended since the last call.

    Attributes:
        token_ids: the list indexed (the request's own ``token_ids``, not a copy: a
            request whose list was replaced is indexed again).
        indexed_end: every n-gram ending at or before this position (exclusive end) is
            in ``tables``; always < len(token_ids), so the row's suffix itself is not.
        tail: token_ids[indexed_end - n_max : indexed_end] when it was indexed: a list
            rewritten in place (shrunk and grown again) no longer matches it.
        tables: for n = n_min + i, ``tables[i]`` maps each n-gram (a tuple) to the end
            of its latest occurrence (where the tokens that followed it begin).
    """

    token_ids: list[int]
    indexed_end: int
    tail: list[int]
    tables: list[dict[tuple[int, ...], int]]


class NgramProposer:
    """Prompt lookup proposals (:func:`propose_ngram`), with an incremental index per
    request in :attr:`RequestState.proposer_state`.

    The index assumes a request's ``token_ids`` only grows by appending (by any number
    of tokens between calls); it is rebuilt when the list shrank, is another list
    object, or its last indexed tokens changed. A call costs O(n_max - n_min + 1)
    tuple builds and dict look-ups per row plus O(new tokens) to extend the index; the
    first call for a request indexes its whole prompt. Memory: n_max - n_min + 1 dict
    entries per token of context.

    Args:
        n_min: shortest n-gram matched (``--ngram-min``).
        n_max: longest n-gram matched, tried first (``--ngram-max``).

    Raises:
        ValueError: unless 1 <= n_min <= n_max.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(
                f"--ngram-min ({n_min}) and --ngram-max ({n_max}) must satisfy 1 <= min <= max"
            )
        self.n_min = n_min
        self.n_max = n_max

    def draft_probs(self) -> None:
        """None: n-gram guesses are deterministic (see :class:`shard.speculative.Proposer`)."""
        return None

    def propose(self, requests: Sequence[RequestState], budgets: Sequence[int]) -> list[list[int]]:
        """At most ``budgets[i]`` guesses after ``requests[i]``'s last token: what
        :func:`propose_ngram` gives for its ``token_ids``. A row with budget 0 gets []
        and its index is left as it was (extended on its next call)."""
        assert len(requests) == len(budgets), f"{len(requests)} requests for {len(budgets)} budgets"
        return [
            self._propose_one(r, b) if b > 0 else [] for r, b in zip(requests, budgets, strict=True)
        ]

    def _propose_one(self, request: RequestState, budget: int) -> list[int]:
        tokens = request.token_ids
        index = self._current_index(request)
        length = len(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if n >= length:
                continue
            end = index.tables[n - self.n_min].get(tuple(tokens[length - n :]))
            if end is not None:
                return follow(tokens, end, budget)
        return []

    def _current_index(self, request: RequestState) -> _NgramIndex:
        """The request's index, extended to every n-gram that is followed by a token."""
        tokens = request.token_ids
        index = request.proposer_state
        if not (isinstance(index, _NgramIndex) and self._still_valid(index, tokens)):
            index = _NgramIndex(tokens, 0, [], [{} for _ in range(self.n_max - self.n_min + 1)])
            request.proposer_state = index
        new_end = len(tokens) - 1
        if new_end > index.indexed_end:
            self._extend(index, new_end)
        return index

    def _still_valid(self, index: _NgramIndex, tokens: list[int]) -> bool:
        return (
            index.token_ids is tokens
            and len(index.tables) == self.n_max - self.n_min + 1
            and index.indexed_end < len(tokens)
            and tokens[max(0, index.indexed_end - self.n_max) : index.indexed_end] == index.tail
        )

    def _extend(self, index: _NgramIndex, new_end: int) -> None:
        """Add the n-grams ending in (indexed_end, new_end] (exclusive ends); a later
        occurrence replaces an earlier one in the tables."""
        tokens = index.token_ids
        for i, table in enumerate(index.tables):
            n = self.n_min + i
            first = max(index.indexed_end + 1, n)  # the first end with n tokens before it
            if first > new_end:
                continue
            if new_end - first < _BULK:
                for end in range(first, new_end + 1):
                    table[tuple(tokens[end - n : end])] = end
                continue
            # many n-grams (a prompt): built as tuples in C, by zipping n shifted
            # copies of the window tokens[first - n : new_end]
            window = tokens[first - n : new_end]
            grams = zip(*(window[k : len(window) - n + 1 + k] for k in range(n)), strict=True)
            table.update(zip(grams, range(first, new_end + 1), strict=True))
        index.indexed_end = new_end
        index.tail = tokens[max(0, new_end - self.n_max) : new_end]
