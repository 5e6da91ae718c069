"""Prompt lookup proposals: the brute-force reference on hand-made cases, and the
incremental proposer equal to it on random token streams grown step by step."""

from __future__ import annotations

import random

import pytest

from shard.requests import RequestState
from shard.sampling_types import SamplingParams
from shard.speculative.ngram import NgramProposer, propose_ngram


def request(token_ids: list[int]) -> RequestState:
    return RequestState(1, [0], token_ids, len(token_ids) - 1, 1, SamplingParams())


@pytest.mark.parametrize(
    ("tokens", "num_tokens", "n_min", "n_max", "expected"),
    [
        # the last 2 tokens (3, 4) occurred at 2..3, followed by 5 6 7
        ([1, 2, 3, 4, 5, 6, 7, 3, 4], 3, 2, 2, [5, 6, 7]),
        # past the row's end the guesses repeat it with the match's period (5 6 7 3 4)
        ([1, 2, 3, 4, 5, 6, 7, 3, 4], 10, 2, 2, [5, 6, 7, 3, 4, 5, 6, 7, 3, 4]),
        # the latest occurrence wins: (3, 4) at 2 and at 6; 6 is followed by 9
        ([1, 2, 3, 4, 5, 6, 3, 4, 9, 3, 4], 2, 2, 2, [9, 3]),
        # the longest n wins over a later shorter match: (2, 3, 4) at 1 -> 5, while (3, 4)
        # alone occurs later at 6 -> 8
        ([1, 2, 3, 4, 5, 6, 3, 4, 8, 2, 3, 4], 2, 2, 3, [5, 6]),
        ([1, 2, 3, 4, 5, 6, 3, 4, 8, 2, 3, 4], 2, 2, 2, [8, 2]),
        # n_min = 1: only the last token matches
        ([7, 1, 8, 2, 8], 2, 1, 3, [2, 8]),
        # an occurrence overlapping the suffix (a run of one token): the run goes on
        ([5, 9, 9, 9], 4, 2, 2, [9, 9, 9, 9]),
        # a run of two tokens, period 2
        ([1, 5, 6, 5, 6, 5], 5, 1, 2, [6, 5, 6, 5, 6]),
        # no match, budget 0, a too-short context
        ([1, 2, 3, 4], 3, 1, 2, []),
        ([1, 2, 1, 2], 0, 1, 2, []),
        ([4], 3, 1, 1, []),
        ([], 3, 1, 1, []),
    ],
)
def test_reference_cases(
    tokens: list[int], num_tokens: int, n_min: int, n_max: int, expected: list[int]
) -> None:
    assert propose_ngram(tokens, num_tokens, n_min, n_max) == expected
    proposer = NgramProposer(n_min, n_max)
    assert proposer.propose([request(list(tokens))], [num_tokens]) == [expected]


@pytest.mark.parametrize(("n_min", "n_max"), [(0, 2), (3, 2), (-1, -1)])
def test_bad_ngram_sizes_name_the_flags(n_min: int, n_max: int) -> None:
    with pytest.raises(ValueError, match=r"--ngram-min.*--ngram-max"):
        NgramProposer(n_min, n_max)


@pytest.mark.parametrize(
    ("n_min", "n_max", "vocab", "max_growth"),
    [
        (2, 4, 6, 1),
        (1, 3, 4, 5),
        (3, 3, 3, 8),
        (2, 5, 20, 3),
    ],
)
def test_incremental_index_equals_reference(
    n_min: int, n_max: int, vocab: int, max_growth: int
) -> None:
    """Rows grown by 1 to ``max_growth`` tokens between calls, some skipped (budget 0)
    for a while: every proposal equals the reference's on the whole list."""
    rng = random.Random(n_min * 100 + n_max * 10 + vocab)
    proposer = NgramProposer(n_min, n_max)
    rows = [request([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]) for _ in range(8)]
    matched = 0
    for _ in range(150):
        budgets = [rng.choice([0, 1, 3, 5]) for _ in rows]
        got = proposer.propose(rows, budgets)
        for r, b, g in zip(rows, budgets, got, strict=True):
            assert g == propose_ngram(r.token_ids, b, n_min, n_max), r.token_ids
            matched += bool(g)
            # a row copies its own past at times, so long matches occur
            if g and rng.random() < 0.5:
                r.token_ids.extend(g)
            else:
                r.token_ids.extend(rng.randrange(vocab) for _ in range(rng.randint(1, max_growth)))
    assert matched > 100


def test_index_rebuilt_when_tokens_shrink_or_change() -> None:
    proposer = NgramProposer(2, 3)
    row = request([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert proposer.propose([row], [2]) == [[3, 4]]
    # shrunk (a rollback): (2, 3, 4) and (3, 4) must not point past the new end
    del row.token_ids[6:]
    assert proposer.propose([row], [4]) == [propose_ngram(row.token_ids, 4, 2, 3)]
    # rewritten in place to the same length plus one
    row.token_ids[:] = [9, 8, 7, 9, 8, 5, 6, 9, 8]
    assert proposer.propose([row], [2]) == [[5, 6]]
    # replaced by another list (a recompute)
    row.token_ids = [4, 4, 1, 4, 4]
    assert proposer.propose([row], [3]) == [[1, 4, 4]]
    # a state left by another proposer's configuration
    assert NgramProposer(1, 1).propose([row], [1]) == [propose_ngram(row.token_ids, 1, 1, 1)]
