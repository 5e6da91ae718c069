"""Speculative Decodes of grammar-constrained rows: every verified position is masked
with the grammar state after the guesses before it, guesses the grammar refuses are
cut, and the output equals decoding without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from router.grammar import json_schema_grammar
from shard.model_runner import ModelRunner
from shard.records import PrefillStep
from shard.speculative.step import SpeculativeDecoder
from tests.unit.shard.helpers import BlockPool, DecodeDriver, make_runner
from tests.unit.shard.test_grammar import EOS, SCHEMA, new_request, text_of, until_eos
from tests.unit.shard.test_speculative_step import ScriptedProposer, SpecDriver

STEPS = 60
__all__ = ["text_of"]  # the fixture, imported to be found here


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return make_runner(tiny_model_dir, kv_cache_bytes=8 * 1024 * 1024)


def start(runner: ModelRunner, do_sample: bool) -> tuple[BlockPool, dict[int, list[int]]]:
    """Prefill two JSON-constrained requests and an unconstrained one; their first
    tokens."""
    pool = BlockPool(runner.num_blocks, seed=3)
    grammar = json_schema_grammar(SCHEMA)
    reqs = [new_request(i, pool, grammar, do_sample=do_sample, seed=i) for i in (1, 2)]
    reqs.append(new_request(3, pool, do_sample=do_sample, seed=3))  # unconstrained
    out = runner.prefill(PrefillStep(tuple(reqs)))
    return pool, {g.request_id: [g.token_id] for g in out.generations}


def plain_tokens(runner: ModelRunner, do_sample: bool) -> dict[int, list[int]]:
    pool, tokens = start(runner, do_sample)
    driver = DecodeDriver(runner, pool)
    for _ in range(STEPS):
        for rid, token in driver.step().items():
            tokens[rid].append(token)
    runner.reset()
    return tokens


def spec_tokens(runner: ModelRunner, do_sample: bool, proposer: ScriptedProposer
                ) -> dict[int, list[int]]:
    pool, tokens = start(runner, do_sample)
    runner.speculator = SpeculativeDecoder(runner, proposer)
    driver = SpecDriver(runner, pool, k=3)
    try:
        while min(len(t) for t in tokens.values()) < STEPS + 1:
            got, _, _ = driver.spec_step()
            for rid, toks in got.items():
                tokens[rid].extend(toks)
    finally:
        runner.speculator = None
        runner.reset()
    return {rid: t[: STEPS + 1] for rid, t in tokens.items()}


@pytest.mark.parametrize(("do_sample", "right"), [(False, None), (True, 1)])
def test_constrained_rows_emit_what_plain_decodes_emit(runner, text_of, do_sample, right
                                                       ) -> None:
    """Guesses that are the plain run's own tokens (``right`` None: all; 1: the first
    of each step, then tokens the grammar mostly refuses): the tokens equal the plain
    run's, and the JSON still validates."""
    plain = plain_tokens(runner, do_sample)
    proposer = ScriptedProposer(plain, right=right, seed=4)
    spec = spec_tokens(runner, do_sample, proposer)
    assert spec == plain
    for rid in (1, 2):
        assert EOS in spec[rid]
        jsonschema.validate(json.loads(text_of(until_eos(spec[rid]))), SCHEMA)


def test_refused_guesses_are_cut_before_the_forward(runner) -> None:
    """A constrained row's guesses the grammar refuses are not verified: the mask and
    the kept guesses say so, and the matcher's state is unchanged afterwards."""
    pool = BlockPool(runner.num_blocks, seed=5)
    runner.prefill(PrefillStep((new_request(1, pool, json_schema_grammar(SCHEMA)),)))
    row = runner.requests.decoding[0]
    assert row.grammar is not None
    grammar = row.grammar
    junk = runner.grammars.tokenizer.tokenize_str("xx")  # never valid where JSON starts
    mask, kept = runner.grammars.draft_mask([grammar, None], [junk, junk], runner.device)
    assert kept == [[], junk]
    assert mask is not None and mask.rows.tolist() == [0]
    good = int(mask.allowed[0].nonzero()[0])  # a token the grammar allows next
    mask, kept = runner.grammars.draft_mask([grammar], [[good]], runner.device)
    assert kept == [[good]] and mask is not None and mask.rows.tolist() == [0, 1]
    bad = int((~mask.allowed[1]).nonzero()[0])  # one it refuses after that
    before = mask.allowed.clone()
    mask, kept = runner.grammars.draft_mask([grammar], [[good, bad, good]], runner.device)
    assert kept == [[good]]
    assert mask is not None and bool((mask.allowed == before).all())  # rolled back
    runner.reset()
