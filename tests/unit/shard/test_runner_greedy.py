"""Greedy tokens through the model runner equal transformers ``generate`` — alone, in
one batch, joining a running batch at different steps, with a cached prefix, with
chunked prefill, and with permuted non-contiguous block tables."""

from __future__ import annotations

import pytest

from shard.pending_step import PendingStep
from tests.unit.shard.conftest import NEW_TOKENS
from tests.unit.shard.helpers import (
    DEVICE,
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


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_each_prompt_alone(runner, expected_greedy, index: int) -> None:
    pool = BlockPool(runner.num_blocks, seed=index)
    prompt = PROMPTS[index]
    tokens = [prefill(runner, 1, request(10, prompt, pool.for_tokens(len(prompt))))[10]]
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step([1])[10])
    assert tokens == expected_greedy[index]


def test_all_prompts_in_one_batch(runner, expected_greedy) -> None:
    # the CPU's by-sequence attention reads a head-major cache; GPU kernels token-major
    assert runner.kv_cache[0].head_major == (runner.device.type == "cpu")
    pool = BlockPool(runner.num_blocks, seed=3)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(PROMPTS)]
    got = {rid: [tok] for rid, tok in prefill(runner, 5, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for _ in range(NEW_TOKENS - 1):
        for rid, tok in driver.step([5]).items():
            got[rid].append(tok)
    assert [got[i] for i in range(len(PROMPTS))] == expected_greedy


def test_requests_join_and_leave_running_batch(runner, expected_greedy) -> None:
    """Prefill A; decode 3; prefill B; Decode([A, B]); ...; C and D join later; requests
    are filtered out once they have NEW_TOKENS tokens."""
    pool = BlockPool(runner.num_blocks, seed=11)
    driver = DecodeDriver(runner, pool)
    got: dict[int, list[int]] = {}
    join_at = {0: 0, 1: 3, 2: 4, 3: 9}  # request index -> decode step before which it joins
    running: list[int] = []
    step = 0
    while len(got) < len(PROMPTS) or any(len(v) < NEW_TOKENS for v in got.values()):
        for i, at in join_at.items():
            if at == step:
                batch_id = 100 + i
                first = prefill(
                    runner, batch_id, request(i, PROMPTS[i], pool.for_tokens(len(PROMPTS[i])))
                )
                got[i] = [first[i]]
                running.append(batch_id)
        if running:
            out = driver.step(running)
            running = running[:1]  # concatenated under the first batch id
            for rid, tok in out.items():
                got[rid].append(tok)
            done = [rid for rid, toks in got.items() if len(toks) >= NEW_TOKENS]
            keep = [r for r in runner.batches.get(running[0]).request_ids if r not in done]
            info = runner.filter_batch(running[0], keep)
            assert list(info.request_ids) == keep
            if not keep:
                running = []
        step += 1
    assert [got[i][:NEW_TOKENS] for i in range(len(PROMPTS))] == expected_greedy


@pytest.mark.parametrize("cache_len", [1, 4, 16, 39])
def test_prefix_cache_hit(runner, expected_greedy, cache_len: int) -> None:
    """Write the prefix via an earlier prefill into the same blocks; a later prefill with
    cache_len computes only the rest and yields the same tokens."""
    prompt = PROMPTS[3]  # 40 tokens
    pool = BlockPool(runner.num_blocks, seed=cache_len)
    blocks = pool.for_tokens(len(prompt))
    prefill(runner, 1, request(1, prompt[:cache_len], blocks[: -(-cache_len // 4)]))
    runner.clear_cache(1)
    tokens = [prefill(runner, 2, request(2, prompt, blocks, cache_len=cache_len))[2]]
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step([2])[2])
    assert tokens == expected_greedy[3]


def test_chunked_prefill_with_partial_chunks(runner, expected_greedy) -> None:
    """Prompts prefilled in chunks (partial=True keeps no state) together with a
    non-chunked request in the same batches."""
    pool = BlockPool(runner.num_blocks, seed=21)
    long_prompt, short_prompt = PROMPTS[3], PROMPTS[1]
    blocks = pool.for_tokens(len(long_prompt))
    out = runner.prefill(_batch(1, request(3, long_prompt[:13], blocks[:4], partial=True)))
    assert out.generations == () and out.batch.request_ids == ()
    assert 1 not in runner.batches
    out = runner.prefill(
        _batch(
            2,
            request(3, long_prompt[:30], blocks[:8], cache_len=13, partial=True),
            request(1, short_prompt, pool.for_tokens(len(short_prompt))),
        )
    )
    assert [g.request_id for g in out.generations] == [1] and out.batch.request_ids == (1,)
    first = prefill(runner, 3, request(3, long_prompt, blocks, cache_len=30))
    got = {1: [out.generations[0].token_id], 3: [first[3]]}
    driver = DecodeDriver(runner, pool)
    batch_ids = [2, 3]
    for _ in range(NEW_TOKENS - 1):
        for rid, tok in driver.step(batch_ids).items():
            got[rid].append(tok)
        batch_ids = [2]  # batch 3 was concatenated into batch 2
    assert 3 not in runner.batches
    assert got[1] == expected_greedy[1]
    assert got[3] == expected_greedy[3]


def test_recompute_after_preemption(runner, expected_greedy) -> None:
    """A preempted request comes back with prompt + generated tokens and num_generated;
    continuing from there gives the same tokens."""
    pool = BlockPool(runner.num_blocks, seed=5)
    prompt, expected = PROMPTS[2], expected_greedy[2]
    k = 7
    ids = prompt + expected[:k]
    tokens = [prefill(runner, 1, request(1, ids, pool.for_tokens(len(ids)), num_generated=k))[1]]
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS - k:
        tokens.append(driver.step([1])[1])
    assert tokens == expected[k:]


def _batch(batch_id, *requests):
    from shard.records import PrefillBatch

    return PrefillBatch(batch_id, tuple(requests))


def test_next_step_launched_before_the_previous_is_read(llama, expected_greedy) -> None:
    """launch_decode of step N+1 before finish_step of step N (what the servicer does
    when the router has sent N+1 already) gives the same tokens as one step at a time."""
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=3)
    prompt = PROMPTS[2]
    first = prefill(runner, 1, request(1, prompt, pool.for_tokens(len(prompt) + 8)))
    got = [first[1]]
    pending = runner.launch_decode([1])
    for _ in range(5):
        assert isinstance(pending, PendingStep)
        following = runner.launch_decode([1])
        got.append(runner.finish_step(pending).generations[0].token_id)
        pending = following
    assert isinstance(pending, PendingStep)
    got.append(runner.finish_step(pending).generations[0].token_id)
    assert got == expected_greedy[2][:7]
    state = runner.batches.get(1).requests[0]
    assert state.token_ids[len(prompt):] == got and state.seq_len == len(prompt) + 6


def test_decodes_launched_before_the_prefill_is_read(llama, expected_greedy) -> None:
    """A new batch's prefill is launched, then decodes of it joined with a running batch
    are launched before the prefill's tokens are read (the servicer launches the next
    step while one computes): the decodes take the first tokens on the device, and the
    tokens equal one step at a time."""
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=5)
    a, b = PROMPTS[1], PROMPTS[2]
    got = {1: [prefill(runner, 1, request(1, a, pool.for_tokens(len(a) + 8)))[1]]}
    got[1].append(runner.decode([1]).generations[0].token_id)
    pending = [runner.launch_prefill(_batch(2, request(2, b, pool.for_tokens(len(b) + 8))))]
    state = runner.batches.get(2).requests[0]
    assert state.token_ids == list(b) and state.seq_len == len(b)  # its id is not read yet
    pending.append(runner.launch_decode([1, 2]))
    pending.append(runner.launch_decode([1]))
    assert all(isinstance(p, PendingStep) for p in pending)
    outs = [runner.finish_step(p) for p in pending]  # type: ignore[arg-type]
    got[2] = [outs[0].generations[0].token_id]
    for out in outs[1:]:
        for g in out.generations:
            got[g.request_id].append(g.token_id)
    assert got[1] == expected_greedy[1][:4]
    assert got[2] == expected_greedy[2][:3]
    assert state.token_ids[len(b):] == got[2] and state.seq_len == len(b) + 2


def test_a_penalized_decode_waits_for_the_prefill_it_follows(llama) -> None:
    """A decode with penalties needs the host's token history, so it waits until the
    prefill launched before it is read (in another thread, as the servicer does): the
    same tokens as one step at a time."""
    import threading
    import time

    from shard.sampling_types import SamplingParams

    sampling = SamplingParams(repetition_penalty=1.3)
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=6)
    prompt = PROMPTS[0]
    first = prefill(runner, 1, request(1, prompt, pool.for_tokens(len(prompt) + 8),
                                       sampling=sampling))[1]
    reference = [first] + [runner.decode([1]).generations[0].token_id for _ in range(3)]
    runner.clear_cache()
    pending = runner.launch_prefill(_batch(2, request(2, prompt, pool.for_tokens(
        len(prompt) + 8), sampling=sampling)))
    read: list[int] = []

    def finish_later() -> None:
        time.sleep(0.2)  # the decode below is launched meanwhile and must wait
        read.append(runner.finish_step(pending).generations[0].token_id)  # type: ignore[arg-type]

    reader = threading.Thread(target=finish_later)
    reader.start()
    step = runner.launch_decode([2])
    assert read  # the launch returned only once the prefill's tokens were read
    reader.join()
    got = [*read, runner.finish_step(step).generations[0].token_id]  # type: ignore[arg-type]
    got += [runner.decode([2]).generations[0].token_id for _ in range(2)]
    assert got == reference


@pytest.mark.skipif(DEVICE != "cuda", reason="the host runs ahead of the device only on CUDA")
def test_launches_do_not_wait_for_the_device(llama, expected_greedy) -> None:
    """With the device busy, a prefill (a partial chunk beside a whole prompt) and the
    decode after it are launched without the host waiting: neither step has run when
    both launches return; their tokens are those of one step at a time."""
    import torch

    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=7)
    prompt, other = PROMPTS[3], PROMPTS[0]
    batch = _batch(1, request(2, other[:4], pool.for_tokens(4), partial=True),
                   request(1, prompt, pool.for_tokens(len(prompt) + 4)))
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # ~1 s of device time queued ahead of the steps
    prefilled = runner.launch_prefill(batch)
    decoded = runner.launch_decode([1])
    assert isinstance(prefilled, PendingStep) and isinstance(decoded, PendingStep)
    assert not prefilled.host.ready() and not decoded.host.ready()
    got = [runner.finish_step(p).generations[0].token_id for p in (prefilled, decoded)]
    assert got == expected_greedy[3][:2]
