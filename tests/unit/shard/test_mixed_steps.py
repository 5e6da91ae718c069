"""Mixed steps (a Prefill with ``decode``): the decoding rows compute their next token
in the same forward as the prompt chunks, with the tokens a Decode would give them."""

from __future__ import annotations

import pytest
import torch

from shard.records import CachedRequest, PrefillStep, StepOutput
from shard.sampling_types import SamplingParams
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


@pytest.fixture
def runner(llama):
    return make_runner(llama[0])


def row_appends(runner, pool: BlockPool) -> tuple[CachedRequest, ...]:
    """A block for each row whose next token crosses into a new block (as the router)."""
    return tuple(
        CachedRequest(r.request_id, tuple(pool.take(1)))
        for r in runner.requests.decoding
        if r.seq_len + 1 > len(r.block_table) * BLOCK_SIZE
    )


def mixed(runner, pool: BlockPool, *new, cached=(), finished=()) -> StepOutput:
    return runner.prefill(PrefillStep(tuple(new), tuple(cached), tuple(finished), decode=True,
                                      row_appends=row_appends(runner, pool)))


def test_rows_decode_while_a_prompt_is_prefilled_in_chunks(runner, expected_greedy) -> None:
    """Rows 0 and 1 decode; the 40-token prompt 3 comes in chunks of 13, 13 and 14
    within mixed steps, and prompt 2 joins whole in the last one: every request's
    greedy tokens equal transformers', and the rows keep their order."""
    pool = BlockPool(runner.num_blocks, seed=5)
    got = {rid: [tok] for rid, tok in prefill(
        runner, *(request(i, PROMPTS[i], pool.for_tokens(len(PROMPTS[i]))) for i in (0, 1))
    ).items()}
    long_blocks = pool.for_tokens(len(PROMPTS[3]))
    steps = [
        ((request(3, PROMPTS[3], long_blocks, num_tokens=13),), ()),
        ((), (CachedRequest(3, num_tokens=13),)),
        ((request(2, PROMPTS[2], pool.for_tokens(len(PROMPTS[2]))),), (CachedRequest(3),)),
    ]
    for new, cached in steps:
        out = mixed(runner, pool, *new, cached=cached)
        assert out.num_rows == 2
        assert [g.request_id for g in out.row_generations] == [0, 1]
        for g in out.generations:
            got.setdefault(g.request_id, []).append(g.token_id)
    assert [g.request_id for g in out.prompt_generations] == [3, 2]
    assert [r.request_id for r in runner.requests.decoding] == [0, 1, 3, 2]
    driver = DecodeDriver(runner, pool)
    while any(len(tokens) < NEW_TOKENS for tokens in got.values()):
        for rid, tok in driver.step().items():
            got[rid].append(tok)
    assert [got[i][:NEW_TOKENS] for i in range(4)] == expected_greedy


def test_a_mixed_step_with_only_a_partial_chunk_samples_the_rows(runner) -> None:
    pool = BlockPool(runner.num_blocks, seed=6)
    prefill(runner, request(0, PROMPTS[1], pool.for_tokens(len(PROMPTS[1]))))
    out = mixed(runner, pool, request(1, PROMPTS[3], pool.for_tokens(40), num_tokens=8))
    assert [g.request_id for g in out.generations] == [0] and out.num_rows == 1
    assert runner.requests.get(0).seq_len == len(PROMPTS[1]) + 1


def _sampled(top_n: int) -> dict[str, object]:
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=50, seed=7,
                            repetition_penalty=1.3, frequency_penalty=0.4)
    return {"sampling": params, "top_n_tokens": top_n}


def test_a_mixed_step_gives_the_rows_what_a_decode_gives(runner) -> None:
    """The same rows (seeded sampling with penalties and top tokens, greedy) stepped by
    Decodes, then again under other ids by mixed steps beside other prompts (sampling
    depends on the seed and the step, not the id or the batch): same tokens, same
    logprobs and top tokens (to float rounding: the forward's shapes differ)."""
    pool = BlockPool(runner.num_blocks, seed=8)
    results = []
    for first_id, use_mixed in ((0, False), (10, True)):
        prefill(runner, request(first_id, PROMPTS[2], pool.for_tokens(17), **_sampled(3)),
                request(first_id + 1, PROMPTS[1], pool.for_tokens(5)),
                finished=tuple(r.request_id for r in runner.requests.decoding))
        steps = []
        for k in range(6):
            if use_mixed:
                other = request(100 + k, PROMPTS[k % 4], pool.for_tokens(len(PROMPTS[k % 4])))
                out = mixed(runner, pool, other)  # it steps with the rows from then on
                steps.append(tuple(g for g in out.row_generations if g.request_id < 100))
            else:
                steps.append(DecodeDriver(runner, pool).step_output())
        results.append(steps)
    decoded, mixed_steps = results
    for a, b in zip(decoded, mixed_steps, strict=True):
        assert [g.token_id for g in a] == [g.token_id for g in b]
        # NOTE: the forwards differ in shape (a mixed step's products have more rows,
        # which may take other GEMM algorithms on a GPU): float32 logprobs agree to
        # rounding, not bit for bit
        torch.testing.assert_close([g.logprob for g in a], [g.logprob for g in b],
                                   rtol=1e-4, atol=1e-4)
        assert [[t.token_id for t in g.top_tokens] for g in a] == [
            [t.token_id for t in g.top_tokens] for g in b]


def test_row_appends_need_decode_and_name_rows(runner) -> None:
    pool = BlockPool(runner.num_blocks, seed=9)
    prefill(runner, request(0, PROMPTS[1], pool.for_tokens(5)))
    prefill(runner, request(1, PROMPTS[3], pool.for_tokens(40), num_tokens=8))
    with pytest.raises(ValueError, match="mixed step"):
        runner.prefill(PrefillStep(cached_requests=(CachedRequest(1, num_tokens=4),),
                                   row_appends=(CachedRequest(0, (pool.take(1)[0],)),)))
    with pytest.raises(ValueError, match="request 1: its prefill is not complete"):
        runner.prefill(PrefillStep(cached_requests=(CachedRequest(1, num_tokens=4),),
                                   decode=True, row_appends=(CachedRequest(1),)))
