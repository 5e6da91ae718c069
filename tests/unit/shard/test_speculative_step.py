"""Speculative Decodes on the shard (``DecodeStep.num_speculative_tokens``): one forward
verifies each row's guesses; greedy rows emit transformers' tokens whatever the guesses,
seeded sampled rows the tokens a plain Decode samples, and the contract's bounds hold."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from shard.records import CachedRequest, DecodeStep, Generation, PrefillStep
from shard.requests import RequestState
from shard.sampling_types import SamplingParams
from shard.speculative.step import SpeculativeDecoder
from tests.unit.shard.conftest import NEW_TOKENS
from tests.unit.shard.helpers import (
    BLOCK_SIZE,
    PROMPTS,
    BlockPool,
    DecodeDriver,
    make_runner,
    prefill,
    request,
)


class ScriptedProposer:
    """Guesses from a script: ``truth[request id]`` (the reference continuation), right
    for the first ``right`` guesses of each step and wrong after (``right=None``: always
    right); ``calls`` records the budgets it was given."""

    def __init__(self, truth: dict[int, list[int]], right: int | None = None,
                 seed: int = 0) -> None:
        self.truth, self.right = truth, right
        self.rng = random.Random(seed)
        self.calls: list[list[int]] = []

    def draft_probs(self) -> None:
        return None  # deterministic guesses

    def propose(self, requests: Sequence[RequestState], budgets: Sequence[int]
                ) -> list[list[int]]:
        self.calls.append(list(budgets))
        out = []
        for r, budget in zip(requests, budgets, strict=True):
            # the token after the last one is the reference's token number num_generated
            want = self.truth.get(r.request_id, [])[r.num_generated:r.num_generated + budget]
            right = len(want) if self.right is None else min(self.right, len(want))
            wrong = [(t + 1 + self.rng.randrange(100)) % 256 for t in want[right:]]
            out.append(want[:right] + wrong)
        return out


class SpecDriver(DecodeDriver):
    """Speculative Decodes with ``k`` guesses per row, blocks appended for the longest
    outcome as the router does; collects each row's tokens."""

    def __init__(self, runner, pool: BlockPool, k: int,
                 bounds: dict[int, int] | None = None) -> None:
        super().__init__(runner, pool)
        self.k, self.bounds = k, bounds or {}

    def spec_step(self) -> tuple[dict[int, list[int]], tuple[Generation, ...], tuple[int, ...]]:
        cached = []
        for r in self.runner.requests.decoding:
            bound = self.bounds.get(r.request_id, 0)
            need = r.seq_len + (bound or 1 + self.k)
            blocks = -(-need // BLOCK_SIZE) - len(r.block_table)
            if blocks > 0 or bound:
                cached.append(CachedRequest(r.request_id, tuple(self.pool.take(max(blocks, 0))),
                                            bound))
        out = self.runner.decode(DecodeStep(tuple(cached), num_speculative_tokens=self.k))
        tokens: dict[int, list[int]] = {}
        for g in out.generations:
            tokens.setdefault(g.request_id, []).append(g.token_id)
        return tokens, out.generations, out.num_tokens


@pytest.fixture
def runner(llama):
    return make_runner(llama[0])


def start(runner, pool: BlockPool, prompts: Sequence[list[int]],
          sampling: SamplingParams | None = None, **kw) -> dict[int, list[int]]:
    firsts = prefill(runner, *(request(i, p, pool.for_tokens(len(p)), sampling=sampling, **kw)
                               for i, p in enumerate(prompts)))
    return {rid: [tok] for rid, tok in firsts.items()}


@pytest.mark.parametrize("right", [None, 0, 1, 2])
def test_greedy_rows_emit_transformers_tokens_whatever_the_guesses(
        runner, expected_greedy, right) -> None:
    """Four rows of different lengths, k = 3: guesses all right, all wrong, or right
    for the first one or two; every row's tokens equal transformers' greedy ones, and a
    step emits accepted + 1 tokens per row."""
    truth = {i: expected_greedy[i] for i in range(4)}
    proposer = ScriptedProposer(truth, right)
    runner.speculator = SpeculativeDecoder(runner, proposer)
    pool = BlockPool(runner.num_blocks, seed=11)
    got = start(runner, pool, PROMPTS)
    driver = SpecDriver(runner, pool, k=3)
    while min(len(t) for t in got.values()) < NEW_TOKENS:
        guessable = max(len(t) for t in got.values()) + 3 <= NEW_TOKENS  # truth ends there
        tokens, _, counts = driver.spec_step()
        for rid, toks in tokens.items():
            got[rid].extend(toks)
        assert list(counts) == [len(tokens[i]) for i in range(4)]
        if guessable:
            assert all(c == (4 if right is None else right + 1) for c in counts)
    assert [got[i][:NEW_TOKENS] for i in range(4)] == expected_greedy
    assert all(budgets == [3, 3, 3, 3] for budgets in proposer.calls)


def test_row_bounds_limit_the_guesses_and_the_tokens(runner, expected_greedy) -> None:
    """A cached request's num_tokens bounds its row: num_tokens 1 = no guess, 2 = one."""
    proposer = ScriptedProposer({i: expected_greedy[i] for i in range(3)})
    runner.speculator = SpeculativeDecoder(runner, proposer)
    pool = BlockPool(runner.num_blocks, seed=12)
    start(runner, pool, PROMPTS[:3])
    driver = SpecDriver(runner, pool, k=4, bounds={0: 1, 1: 2})
    _, _, counts = driver.spec_step()
    assert proposer.calls == [[0, 1, 4]]
    assert counts == (1, 2, 5)


def test_a_step_without_guesses_is_a_plain_decode(runner, expected_greedy) -> None:
    runner.speculator = SpeculativeDecoder(runner, ScriptedProposer({}))
    pool = BlockPool(runner.num_blocks, seed=13)
    got = start(runner, pool, PROMPTS[:2])
    tokens, _, counts = SpecDriver(runner, pool, k=3).spec_step()
    assert counts == ()  # a plain Decode's answer: one token per row
    assert {rid: got[rid] + toks for rid, toks in tokens.items()} == {
        i: expected_greedy[i][:2] for i in range(2)}


def _sampled_run(runner, pool_seed: int, k: int | None, truth: dict[int, list[int]] | None,
                 steps: int) -> list[list[Generation]]:
    """Each row's generations: plain Decodes (``k`` None) or speculative ones."""
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=40, seed=21,
                            repetition_penalty=1.2, frequency_penalty=0.3)
    pool = BlockPool(runner.num_blocks, seed=pool_seed)
    out: dict[int, list[Generation]] = {i: [] for i in range(3)}
    for g in runner.prefill(_prefill_step(pool, params)).generations:
        out[g.request_id].append(g)
    if k is not None:
        assert truth is not None
        runner.speculator = SpeculativeDecoder(runner, ScriptedProposer(truth, right=None))
        driver = SpecDriver(runner, pool, k=k)
        while min(len(g) for g in out.values()) < steps:
            _, generations, counts = driver.spec_step()
            for g in generations:
                out[g.request_id].append(g)
            runner.accepted = getattr(runner, "accepted", 0) + sum(counts) - len(counts)
    else:
        plain = DecodeDriver(runner, pool)
        for _ in range(steps - 1):
            for g in plain.step_output():
                out[g.request_id].append(g)
    return [out[i][:steps] for i in range(3)]


def _prefill_step(pool: BlockPool, params: SamplingParams) -> PrefillStep:
    return PrefillStep(tuple(
        request(i, PROMPTS[i + 1], pool.for_tokens(len(PROMPTS[i + 1])), sampling=params,
                top_n_tokens=3)
        for i in range(3)))


def test_seeded_sampling_with_penalties_emits_what_plain_decodes_sample(llama) -> None:
    """Sampled rows (temperature, top-k, repetition and frequency penalties, a seed, top
    tokens): guesses that are the plain run's own tokens are all accepted, and the
    tokens, logprobs and alternatives equal the plain run's."""
    steps = 16
    plain = _sampled_run(make_runner(llama[0]), 14, None, None, steps)
    truth = {i: [g.token_id for g in plain[i]] for i in range(3)}
    spec_runner = make_runner(llama[0])
    spec = _sampled_run(spec_runner, 14, 3, truth, steps)
    assert spec_runner.accepted >= 3 * (steps - 4)  # the guesses were taken, not redone
    for p_row, s_row in zip(plain, spec, strict=True):
        assert [g.token_id for g in s_row] == [g.token_id for g in p_row]
        assert [g.logprob for g in s_row] == pytest.approx([g.logprob for g in p_row], abs=1e-4)
        assert [[t.token_id for t in g.top_tokens] for g in s_row] == [
            [t.token_id for t in g.top_tokens] for g in p_row]


def test_wrong_guesses_of_a_sampled_row_change_nothing(llama) -> None:
    """Guesses that are always wrong are rejected, and the seeded row samples on as
    without speculation."""
    steps = 10
    plain = _sampled_run(make_runner(llama[0]), 15, None, None, steps)
    wrong = {i: [(g.token_id + 7) % 256 for g in plain[i]] for i in range(3)}
    spec = _sampled_run(make_runner(llama[0]), 15, 2, wrong, steps)
    assert [[g.token_id for g in row] for row in spec] == [
        [g.token_id for g in row] for row in plain]


def test_contract_errors(runner) -> None:
    pool = BlockPool(runner.num_blocks, seed=16)
    start(runner, pool, PROMPTS[:1])
    row = runner.requests.decoding[0]
    # blocks for one token only, not for 1 + 3
    short = -(-(row.seq_len + 1) // BLOCK_SIZE) - len(row.block_table)
    runner.speculator = SpeculativeDecoder(runner, ScriptedProposer({}))
    if -(-(row.seq_len + 4) // BLOCK_SIZE) > len(row.block_table) + max(short, 0):
        with pytest.raises(ValueError, match="tokens need"):
            runner.decode(DecodeStep((CachedRequest(0, tuple(pool.take(max(short, 0)))),),
                                     num_speculative_tokens=3))
    with pytest.raises(ValueError, match="at most 1 \\+ num_speculative_tokens = 3"):
        runner.decode(DecodeStep((CachedRequest(0, (), 4),), num_speculative_tokens=2))
    runner.speculator = None  # a shard started without a proposer
    with pytest.raises(ValueError, match="speculative decoding is off"):
        runner.decode(DecodeStep(num_speculative_tokens=2))
