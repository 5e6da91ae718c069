"""Model runner features beyond greedy: prompt logprobs, top-n, seeded sampling in
different batch compositions, repetition penalty vs transformers, warmup sizing."""

from __future__ import annotations

import pytest
import torch

from shard.errors import KVCacheTooSmallError, NotWarmedUpError
from shard.records import PrefillStep
from shard.sampling_types import SamplingParams
from tests.unit.shard.helpers import (
    PROMPTS,
    BlockPool,
    DecodeDriver,
    cpu_only,
    hf_logits,
    make_runner,
    prefill,
    request,
)


@pytest.fixture
def runner(llama):
    return make_runner(llama[0])


@pytest.mark.parametrize("cache_len", [0, 1, 9])
def test_prompt_logprobs_match_transformers(runner, llama, cache_len: int) -> None:
    prompt = PROMPTS[2]
    pool = BlockPool(runner.num_blocks, seed=2)
    blocks = pool.for_tokens(len(prompt))
    if cache_len:  # the prefix's K/V, written by a first chunk of a request that leaves
        assert prefill(runner, request(9, prompt, blocks, num_tokens=cache_len)) == {}
    out = runner.prefill(PrefillStep(
        (request(1, prompt, blocks, cache_len=cache_len, prompt_logprobs=True),),
        finished_request_ids=(9,) if cache_len else (),
    ))
    lps = torch.tensor(out.generations[0].prompt_logprobs)
    ref = hf_logits(llama[1], prompt).log_softmax(-1)
    start = max(cache_len, 1)
    expected = ref[start - 1 : -1].gather(1, torch.tensor(prompt[start:])[:, None]).squeeze(1)
    assert lps.shape == expected.shape == (len(prompt) - start,)
    torch.testing.assert_close(lps, expected, atol=1e-5, rtol=1e-5)
    g = out.generations[0]
    torch.testing.assert_close(torch.tensor(g.logprob), ref[-1].max(), atol=1e-5, rtol=1e-5)


def test_top_n_tokens(runner, llama) -> None:
    prompt = PROMPTS[1]
    out = runner.prefill(
        PrefillStep((request(1, prompt, [0, 1], top_n_tokens=4), request(2, prompt, [2, 3])))
    )
    ref_lp, ref_ids = hf_logits(llama[1], prompt)[-1].log_softmax(-1).topk(4)
    top = out.generations[0].top_tokens
    assert [t.token_id for t in top] == ref_ids.tolist()
    torch.testing.assert_close(torch.tensor([t.logprob for t in top]), ref_lp, atol=1e-5, rtol=1e-5)
    assert out.generations[1].top_tokens == ()


def _sampled_run(runner, others: int, seed: int, steps: int = 8) -> list[int]:
    """Sample PROMPTS[2] with ``seed`` next to ``others`` unrelated requests."""
    runner.reset()
    pool = BlockPool(runner.num_blocks, seed=others)
    params = SamplingParams(do_sample=True, seed=seed, temperature=1.5, top_k=50)
    reqs = [
        request(
            i + 10,
            PROMPTS[i % 4],
            pool.for_tokens(len(PROMPTS[i % 4])),
            sampling=SamplingParams(do_sample=True, seed=i),
        )
        for i in range(others)
    ]
    target = request(1, PROMPTS[2], pool.for_tokens(len(PROMPTS[2])), sampling=params)
    tokens = [prefill(runner, *reqs, target)[1]]
    driver = DecodeDriver(runner, pool)
    for _ in range(steps - 1):
        tokens.append(driver.step()[1])
    return tokens


def test_seeded_sampling_independent_of_batch(runner) -> None:
    alone = _sampled_run(runner, 0, seed=123)
    assert _sampled_run(runner, 3, seed=123) == alone
    assert _sampled_run(runner, 1, seed=123) == alone
    assert _sampled_run(runner, 0, seed=124) != alone


def test_repetition_penalty_matches_transformers(runner, llama) -> None:
    prompt = PROMPTS[2]
    with torch.inference_mode():
        out = llama[1].generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    pool = BlockPool(runner.num_blocks)
    params = SamplingParams(repetition_penalty=1.8)
    tokens = [
        prefill(runner, request(1, prompt, pool.for_tokens(len(prompt)), sampling=params))[1]
    ]
    driver = DecodeDriver(runner, pool)
    while len(tokens) < 12:
        tokens.append(driver.step()[1])
    assert tokens == expected


@cpu_only
def test_warmup_sizes_cache_and_names_flags(llama) -> None:
    runner = make_runner(llama[0], kv_cache_bytes=64 * 1024, warmup=False)
    with pytest.raises(NotWarmedUpError):
        runner.prefill(PrefillStep((request(1, [5], [0]),)))
    # 64 KiB / 2 KiB per block = 32 blocks of 4 tokens = 128 tokens
    assert runner.warmup(max_batch_prefill_tokens=100, max_total_tokens=40) == 32
    with pytest.raises(
        KVCacheTooSmallError, match="raise --kv-cache-bytes or lower --max-batch-prefill-tokens"
    ):
        runner.warmup(max_batch_prefill_tokens=129, max_total_tokens=129)
    assert runner.num_blocks == 0
    # a prefill budget beyond the cache, in requests that fit it: the worst-case prefill
    # runs on shared blocks (a step never computes more tokens than the router's blocks)
    assert runner.warmup(max_batch_prefill_tokens=1000, max_total_tokens=40) == 32
    with pytest.raises(KVCacheTooSmallError, match="max_total_tokens=200"):
        runner.warmup(max_batch_prefill_tokens=16, max_total_tokens=200)
    # a derived max_total_tokens (the router lowers it to the capacity) need not fit
    assert runner.warmup(max_batch_prefill_tokens=16, max_total_tokens=200,
                         hold_total=False) == 32
    with pytest.raises(KVCacheTooSmallError) as error:
        runner.warmup(max_batch_prefill_tokens=129, max_total_tokens=200, hold_total=False)
    assert "max_total_tokens" not in str(error.value)


def test_warmup_runs_both_prefill_attention_paths(llama) -> None:  # type: ignore[no-untyped-def]
    # A prefix-free prefill and one over a cached prefix can go to different kernels
    # (flash varlen vs our paged kernel on CUDA): warm-up runs both, so neither is
    # compiled in the middle of serving.
    runner = make_runner(llama[0], warmup=False)
    runs: list[list[tuple[int, int]]] = []
    run_chunks = runner.run_chunks

    def spy(chunks, is_prefill):  # type: ignore[no-untyped-def]
        runs.append([(c.start, len(c.token_ids)) for c in chunks])
        return run_chunks(chunks, is_prefill)

    runner.run_chunks = spy  # type: ignore[method-assign]
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=40)
    assert runs[0] == [(0, 40), (0, 24)]  # the worst-case prefill
    assert [(20, 16)] in runs  # tokens of the first sequence over its first half
