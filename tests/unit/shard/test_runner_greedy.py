"""Greedy tokens through the model runner equal transformers ``generate`` — alone, in
one step, joining and leaving the running rows at different steps, with a cached
prefix, with chunked prefill, after a preemption, and with permuted non-contiguous
block tables."""

from __future__ import annotations

import pytest

from shard.pending_step import PendingStep
from shard.records import CachedRequest, DecodeStep, PrefillStep
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
    tokens = [prefill(runner, request(10, prompt, pool.for_tokens(len(prompt))))[10]]
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step()[10])
    assert tokens == expected_greedy[index]


def test_all_prompts_in_one_step(runner, expected_greedy) -> None:
    # the CPU's by-sequence attention reads a head-major cache; GPU kernels token-major
    assert runner.kv_cache[0].head_major == (runner.device.type == "cpu")
    pool = BlockPool(runner.num_blocks, seed=3)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(PROMPTS)]
    got = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for _ in range(NEW_TOKENS - 1):
        out = driver.step()
        assert list(out) == list(range(len(PROMPTS)))  # row order: the prefill's order
        for rid, tok in out.items():
            got[rid].append(tok)
    assert [got[i] for i in range(len(PROMPTS))] == expected_greedy


def test_requests_join_and_leave_the_running_rows(runner, expected_greedy) -> None:
    """Prefill A; decode 3; prefill B; decode A and B; ...; C and D join later; a
    request leaves (finished_request_ids of the next Prefill or Decode) once it has
    NEW_TOKENS tokens. The rows keep the order the requests joined in."""
    pool = BlockPool(runner.num_blocks, seed=11)
    driver = DecodeDriver(runner, pool)
    got: dict[int, list[int]] = {}  # in the order the requests joined
    join_at = {0: 0, 1: 3, 2: 4, 3: 9}  # request index -> decode step before which it joins
    left: set[int] = set()
    leaving: tuple[int, ...] = ()
    step = 0
    while len(got) < len(PROMPTS) or any(len(v) < NEW_TOKENS for v in got.values()):
        joining = [i for i, at in join_at.items() if at == step]
        if joining:
            # the requests that are done leave with this Prefill
            first = prefill(runner, *(request(i, PROMPTS[i], pool.for_tokens(len(PROMPTS[i])))
                                      for i in joining), finished=leaving)
            left.update(leaving)
            leaving = ()
            assert list(first) == joining
            for i in joining:
                got[i] = [first[i]]
        out = driver.step(finished=leaving)
        left.update(leaving)
        rows = [rid for rid in got if rid not in left]
        assert list(out) == rows
        assert [r.request_id for r in runner.requests.decoding] == rows
        for rid, tok in out.items():
            got[rid].append(tok)
        leaving = tuple(rid for rid in rows if len(got[rid]) >= NEW_TOKENS)
        step += 1
    assert [got[i][:NEW_TOKENS] for i in range(len(PROMPTS))] == expected_greedy
    assert runner.decode(DecodeStep(finished_request_ids=leaving)).generations == ()
    assert len(runner.requests) == 0 and runner.requests.rows is None


@pytest.mark.parametrize("cache_len", [1, 4, 16, 39])
def test_prefix_cache_hit(runner, expected_greedy, cache_len: int) -> None:
    """Write the prefix into the same blocks with an earlier request, finished with the
    next Prefill; that Prefill's request with cache_len computes only the rest and
    yields the same tokens."""
    prompt = PROMPTS[3]  # 40 tokens
    pool = BlockPool(runner.num_blocks, seed=cache_len)
    blocks = pool.for_tokens(len(prompt))
    prefill(runner, request(1, prompt[:cache_len], blocks[: -(-cache_len // 4)]))
    tokens = [prefill(runner, request(2, prompt, blocks, cache_len=cache_len), finished=(1,))[2]]
    assert [r.request_id for r in runner.requests.decoding] == [2] and 1 not in runner.requests
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step()[2])
    assert tokens == expected_greedy[3]


@pytest.mark.parametrize("cache_len", [13, 39])
def test_prefix_written_by_a_chunk_of_a_request_that_leaves(
    runner, expected_greedy, cache_len: int
) -> None:
    """The prefix's K/V written by the first chunk of another request that leaves
    before its prompt is complete: they are used as the cached prefix."""
    prompt = PROMPTS[3]
    pool = BlockPool(runner.num_blocks, seed=cache_len + 1)
    blocks = pool.for_tokens(len(prompt))
    assert prefill(runner, request(1, prompt, blocks, num_tokens=cache_len)) == {}
    assert 1 in runner.requests and runner.requests.decoding == []
    tokens = [prefill(runner, request(2, prompt, blocks, cache_len=cache_len), finished=(1,))[2]]
    assert 1 not in runner.requests
    driver = DecodeDriver(runner, pool)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step()[2])
    assert tokens == expected_greedy[3]


def test_chunked_prefill(runner, expected_greedy) -> None:
    """A prompt prefilled in chunks (a NewRequest with num_tokens, then CachedRequests
    by id) together with a whole request in the same steps."""
    pool = BlockPool(runner.num_blocks, seed=21)
    long_prompt, short_prompt = PROMPTS[3], PROMPTS[1]
    blocks = pool.for_tokens(len(long_prompt))
    out = runner.prefill(PrefillStep((request(3, long_prompt, blocks, num_tokens=13),)))
    assert out.generations == ()
    held = runner.requests.get(3)
    assert (held.seq_len, held.decoding, runner.requests.decoding) == (13, False, [])
    out = runner.prefill(PrefillStep(
        (request(1, short_prompt, pool.for_tokens(len(short_prompt))),),
        (CachedRequest(3, num_tokens=17),),
    ))
    assert [g.request_id for g in out.generations] == [1]
    assert held.seq_len == 30 and [r.request_id for r in runner.requests.decoding] == [1]
    # the rest, before a new request of the same step: rows join in the step's order
    first = prefill(runner, request(0, PROMPTS[0], pool.for_tokens(len(PROMPTS[0]))),
                    cached=(CachedRequest(3),))
    assert list(first) == [3, 0]
    assert held.seq_len == len(long_prompt) and held.decoding
    got = {1: [out.generations[0].token_id], 3: [first[3]], 0: [first[0]]}
    driver = DecodeDriver(runner, pool)
    for _ in range(NEW_TOKENS - 1):
        step = driver.step()
        assert list(step) == [1, 3, 0]
        for rid, tok in step.items():
            got[rid].append(tok)
    assert got[0] == expected_greedy[0]
    assert got[1] == expected_greedy[1]
    assert got[3] == expected_greedy[3]


def test_recompute_after_preemption(runner, expected_greedy) -> None:
    """A request preempted after k tokens leaves (finished_request_ids) and comes back
    in the same Prefill as a NewRequest with prompt + generated tokens and num_generated,
    in new blocks; continuing from there gives the same tokens."""
    pool = BlockPool(runner.num_blocks, seed=5)
    prompt, expected = PROMPTS[2], expected_greedy[2]
    k = 7
    driver = DecodeDriver(runner, pool)
    tokens = [prefill(runner, request(1, prompt, pool.for_tokens(len(prompt))))[1]]
    while len(tokens) < k:
        tokens.append(driver.step()[1])
    ids = prompt + tokens
    again = request(1, ids, pool.for_tokens(len(ids)), num_generated=k)
    tokens.append(prefill(runner, again, finished=(1,))[1])
    state = runner.requests.get(1)
    assert (state.seq_len, state.num_generated) == (len(ids), k + 1)
    while len(tokens) < NEW_TOKENS:
        tokens.append(driver.step()[1])
    assert tokens == expected


def test_next_step_launched_before_the_previous_is_read(llama, expected_greedy) -> None:
    """launch_decode of step N+1 before finish_step of step N (what the servicer does
    when the router has sent N+1 already) gives the same tokens as one step at a time."""
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=3)
    prompt = PROMPTS[2]
    first = prefill(runner, request(1, prompt, pool.for_tokens(len(prompt) + 8)))
    got = [first[1]]
    pending = runner.launch_decode()
    for _ in range(5):
        assert isinstance(pending, PendingStep)
        following = runner.launch_decode()
        got.append(runner.finish_step(pending).generations[0].token_id)
        pending = following
    assert isinstance(pending, PendingStep)
    got.append(runner.finish_step(pending).generations[0].token_id)
    assert got == expected_greedy[2][:7]
    state = runner.requests.get(1)
    assert state.token_ids[len(prompt):] == got and state.seq_len == len(prompt) + 6


def test_a_row_leaves_while_its_last_step_is_not_read(llama, expected_greedy) -> None:
    """A Decode that finishes a request is launched before the step that sampled its
    last token is read (the router releases it while that step is in flight): the step
    in flight still returns its token, the rows that stay keep theirs."""
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=8)
    got = {i: [tok] for i, tok in prefill(runner, *(
        request(i, PROMPTS[i], pool.for_tokens(len(PROMPTS[i]) + 8)) for i in (1, 2, 3))).items()}
    pending = runner.launch_decode()
    following = runner.launch_decode(DecodeStep(finished_request_ids=(2,)))
    assert isinstance(pending, PendingStep) and isinstance(following, PendingStep)
    for p in (pending, following):
        for g in runner.finish_step(p).generations:
            got[g.request_id].append(g.token_id)
    for g in runner.decode().generations:
        got[g.request_id].append(g.token_id)
    assert [r.request_id for r in runner.requests.decoding] == [1, 3]
    assert got == {1: expected_greedy[1][:4], 2: expected_greedy[2][:2],
                   3: expected_greedy[3][:4]}


def test_decodes_launched_before_the_prefill_is_read(llama, expected_greedy) -> None:
    """A new request's prefill is launched, then decodes of it beside a running row
    are launched before the prefill's tokens are read (the servicer launches the next
    step while one computes): the decodes take the first tokens on the device, and the
    tokens equal one step at a time."""
    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=5)
    a, b = PROMPTS[1], PROMPTS[2]
    got = {1: [prefill(runner, request(1, a, pool.for_tokens(len(a) + 8)))[1]]}
    got[1].append(runner.decode().generations[0].token_id)
    pending = [runner.launch_prefill(PrefillStep((request(2, b, pool.for_tokens(len(b) + 8)),)))]
    state = runner.requests.get(2)
    assert state.token_ids == list(b) and state.seq_len == len(b)  # its id is not read yet
    assert [r.request_id for r in runner.requests.decoding] == [1, 2]
    pending.append(runner.launch_decode())
    pending.append(runner.launch_decode())
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
    first = prefill(runner, request(1, prompt, pool.for_tokens(len(prompt) + 8),
                                    sampling=sampling))[1]
    reference = [first] + [runner.decode().generations[0].token_id for _ in range(3)]
    runner.reset()
    assert len(runner.requests) == 0
    pending = runner.launch_prefill(PrefillStep((request(2, prompt, pool.for_tokens(
        len(prompt) + 8), sampling=sampling),)))
    read: list[int] = []

    def finish_later() -> None:
        time.sleep(0.2)  # the decode below is launched meanwhile and must wait
        read.append(runner.finish_step(pending).generations[0].token_id)  # type: ignore[arg-type]

    reader = threading.Thread(target=finish_later)
    reader.start()
    step = runner.launch_decode()
    assert read  # the launch returned only once the prefill's tokens were read
    reader.join()
    got = [*read, runner.finish_step(step).generations[0].token_id]  # type: ignore[arg-type]
    got += [runner.decode().generations[0].token_id for _ in range(2)]
    assert got == reference


@pytest.mark.skipif(DEVICE != "cuda", reason="the host runs ahead of the device only on CUDA")
def test_launches_do_not_wait_for_the_device(llama, expected_greedy) -> None:
    """With the device busy, a prefill (a first chunk beside a whole prompt) and the
    decode after it are launched without the host waiting: neither step has run when
    both launches return; their tokens are those of one step at a time."""
    import torch

    runner = make_runner(llama[0])
    pool = BlockPool(runner.num_blocks, seed=7)
    prompt, other = PROMPTS[3], PROMPTS[1]
    step = PrefillStep((request(2, other, pool.for_tokens(len(other)), num_tokens=4),
                        request(1, prompt, pool.for_tokens(len(prompt) + 4))))
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # ~1 s of device time queued ahead of the steps
    prefilled = runner.launch_prefill(step)
    decoded = runner.launch_decode()
    assert isinstance(prefilled, PendingStep) and isinstance(decoded, PendingStep)
    assert not prefilled.host.ready() and not decoded.host.ready()
    got = [runner.finish_step(p).generations[0].token_id for p in (prefilled, decoded)]
    assert got == expected_greedy[3][:2]
