"""Sampling on fixed logits: greedy, truncation masks (checked against transformers'
warpers), penalties, seeded reproducibility, logprobs and top-n."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from shard.penalties import apply_frequency_presence_penalties, apply_repetition_penalty
from shard.sampling import (
    SamplingParams,
    SamplingRow,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    row_seed,
    sample,
)

NEG = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.1)), SamplingRow(SamplingParams())]
    out = sample(logits, rows)
    assert out.token_ids.tolist() == [1, 0]
    expected = logits.log_softmax(-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_token_ids is None


def test_top_n_alternatives() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    out = sample(logits, [SamplingRow(SamplingParams(), top_n=3)])
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.tolist() == [[1, 3, 0]]
    torch.testing.assert_close(out.top_logprobs, logits.log_softmax(-1)[:, [1, 3, 0]])


def test_top_k_1_is_greedy_whatever_the_seed() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        row = SamplingRow(SamplingParams(do_sample=True, top_k=1, seed=seed, temperature=5.0))
        assert sample(logits, [row]).token_ids.item() == logits.argmax().item()


def test_seeded_row_reproducible_alone_and_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 100, generator=gen)
    target = SamplingRow(SamplingParams(do_sample=True, seed=42), step=3)
    alone = sample(logits[2:3], [target]).token_ids.item()
    others = [
        SamplingRow(SamplingParams(do_sample=True, seed=7, top_p=0.5)),
        SamplingRow(SamplingParams()),
        target,
        SamplingRow(SamplingParams(do_sample=True, seed=42), step=4),
        SamplingRow(SamplingParams(do_sample=True, seed=1, top_k=3)),
    ]
    batched = sample(logits, others).token_ids.tolist()
    assert batched[2] == alone
    assert sample(logits[2:3], [target]).token_ids.item() == alone
    # the step is mixed in: 30 steps of the same seed do not all pick the same token
    picks = {
        sample(logits[2:3], [SamplingRow(target.params, step=s)]).token_ids.item()
        for s in range(30)
    }
    assert len(picks) > 5


def test_sampling_frequencies_follow_probabilities() -> None:
    logits = logits_of([0.5, 0.3, 0.2])
    counts = [0, 0, 0]
    for seed in range(3000):
        counts[
            sample(
                logits, [SamplingRow(SamplingParams(do_sample=True, seed=seed))]
            ).token_ids.item()
        ] += 1
    freqs = [c / 3000 for c in counts]
    assert freqs == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


def test_temperature_sharpens() -> None:
    logits = logits_of([0.5, 0.3, 0.2])
    picks = [
        sample(
            logits, [SamplingRow(SamplingParams(do_sample=True, seed=s, temperature=0.05))]
        ).token_ids.item()
        for s in range(200)
    ]
    assert picks.count(0) >= 198


def test_row_seed_depends_on_seed_and_step() -> None:
    assert row_seed(1, 0) != row_seed(1, 1) != row_seed(2, 0)
    assert row_seed(1, 5) == row_seed(1, 5) and 0 <= row_seed(2**64 - 1, 10**9) < 2**63


def test_top_k_top_p_min_p_masks() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05]).repeat(2, 1)
    assert torch.isinf(apply_top_k(logits, torch.tensor([2, 0]))).tolist() == [
        [False, False, True, True],
        [False, False, False, False],
    ]
    assert torch.isinf(apply_top_p(logits, torch.tensor([0.75, 0.85]))).tolist() == [
        [False, False, True, True],
        [False, False, False, True],
    ]
    assert torch.isinf(apply_top_p(logits, torch.tensor([1.0, 0.01]))).tolist() == [
        [False, False, False, False],
        [False, True, True, True],
    ]
    assert torch.isinf(apply_min_p(logits, torch.tensor([0.2, 0.0]))).tolist() == [
        [False, False, False, True],
        [False, False, False, False],
    ]


@pytest.mark.parametrize("value", [0.3, 0.6, 0.9])
def test_warpers_match_transformers(value: float) -> None:
    gen = torch.Generator().manual_seed(int(value * 10))
    logits = torch.randn(4, 64, generator=gen) * 2
    v = torch.full((4,), value)
    pairs = [
        (apply_top_p(logits, v), TopPLogitsWarper(value)(None, logits.clone())),
        (apply_min_p(logits, v), MinPLogitsWarper(value)(None, logits.clone())),
        (apply_typical_p(logits, v), TypicalLogitsWarper(value)(None, logits.clone())),
        (
            apply_top_k(logits, torch.full((4,), int(value * 10))),
            TopKLogitsWarper(int(value * 10))(None, logits.clone()),
        ),
    ]
    for ours, theirs in pairs:
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_typical_p_off_keeps_everything() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    assert not torch.isinf(apply_typical_p(logits, torch.tensor([1.0, 1.0]))).any()


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([2.0, 1.0]), [[0, 1, 1], [0]])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]]


def test_frequency_and_presence_penalties() -> None:
    logits = torch.zeros(2, 5)
    out = apply_frequency_presence_penalties(
        logits, torch.tensor([0.5, 0.0]), torch.tensor([1.0, 0.25]), [[2, 2, 3], [4]]
    )
    assert out.tolist() == [[0.0, 0.0, -2.0, -1.5, 0.0], [0.0, 0.0, 0.0, 0.0, -0.25]]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    rep = SamplingRow(SamplingParams(repetition_penalty=1.5), seen_tokens=[0])
    freq = SamplingRow(SamplingParams(frequency_penalty=0.2), seen_tokens=[0], generated_tokens=[0])
    plain = SamplingRow(SamplingParams(), seen_tokens=[0], generated_tokens=[0])
    out = sample(logits.repeat(3, 1), [rep, freq, plain])
    assert out.token_ids.tolist() == [1, 1, 0]
    # logprob stays the model's, not the penalized one
    torch.testing.assert_close(out.logprobs[0], logits.log_softmax(-1)[0, 1])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0),
    ],
)
def test_invalid_params_raise(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_fast_path_matches_the_general_sampler() -> None:
    from shard.sampling import is_plain_greedy, sample_greedy

    torch.manual_seed(3)
    logits = torch.randn(5, 40) * 4
    fast = sample_greedy(logits)
    full = sample(logits, [SamplingRow(SamplingParams()) for _ in range(5)])
    assert fast.token_ids.tolist() == full.token_ids.tolist()
    assert torch.allclose(fast.logprobs, full.logprobs, atol=1e-5)
    assert is_plain_greedy(SamplingParams())
    assert not is_plain_greedy(SamplingParams(do_sample=True))
    assert not is_plain_greedy(SamplingParams(repetition_penalty=1.2))
    assert not is_plain_greedy(SamplingParams(presence_penalty=0.5))


def test_counter_noise_is_exp1_and_keyed_per_row() -> None:
    from shard.sampling import counter_noise

    keys = torch.tensor([row_seed(s, 3) for s in range(8)], dtype=torch.int64)
    noise = counter_noise(keys, 4096)
    assert noise.shape == (8, 4096) and noise.dtype == torch.float32 and (noise > 0).all()
    # Exp(1): mean 1, variance 1, median ln 2 (32,768 draws: a few standard errors)
    assert abs(noise.mean().item() - 1.0) < 0.03 and abs(noise.var().item() - 1.0) < 0.06
    assert abs((noise < math.log(2)).float().mean().item() - 0.5) < 0.015
    # a row depends on its key only; different keys and columns give different draws
    assert torch.equal(counter_noise(keys[5:6], 4096)[0], noise[5])
    assert not torch.equal(noise[0], noise[1])
    assert noise[0].unique().numel() == 4096


def test_counter_noise_race_picks_tokens_by_probability() -> None:
    """argmax(p / E) with the hashed noise picks each token about p of the time."""
    from shard.sampling import counter_noise

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    keys = torch.tensor([row_seed(7, step) for step in range(4000)], dtype=torch.int64)
    picks = (probs[None, :] / counter_noise(keys, 4)).argmax(dim=-1)
    freq = torch.bincount(picks, minlength=4).float() / len(keys)
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_token_mask_on_every_path_keeps_raw_logprobs() -> None:
    from shard.grammar import unpack_bitmask
    from shard.sampling import TokenMask, sample_greedy

    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0], [0.0, 1.0, 3.0, 2.0]])
    # row 1 (the second) may only produce token 2 or 3: bits 2 and 3 of one int32 word
    allowed = unpack_bitmask(torch.tensor([[0b1100]], dtype=torch.int32), 4, torch.device("cpu"))
    assert allowed.tolist() == [[False, False, True, True]]
    mask = TokenMask(torch.tensor([1]), allowed)
    raw = logits.log_softmax(-1)
    for out in (sample_greedy(logits, mask),
                sample(logits, [SamplingRow(SamplingParams())] * 3, mask),
                sample(logits, [SamplingRow(SamplingParams(repetition_penalty=1.5),
                                            seen_tokens=[0])] * 3, mask)):
        assert out.token_ids.tolist()[1] in (2, 3)
        assert out.token_ids.tolist()[0] == 1 and out.token_ids.tolist()[2] == 2  # unmasked
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    rows = [SamplingRow(SamplingParams(do_sample=True, seed=s)) for s in range(3)]
    sampled = sample(logits, rows, mask)
    assert sampled.token_ids.tolist()[1] in (2, 3)
    assert logits[1, 0] == 5.0  # the caller's logits are not changed
    # bit 31 (the sign bit of an int32 word) reads as allowed too
    high = unpack_bitmask(torch.tensor([[-(2**31)]], dtype=torch.int32), 32, torch.device("cpu"))
    assert high[0].nonzero().flatten().tolist() == [31]


def test_greedy_kernel_failure_on_first_call_falls_back_to_torch() -> None:
    # The kernel's first call (warm-up) decides: a failure there means the torch ops
    # serve from then on; a failure after it has worked is that step's error.
    from shard.kernels.choices import KernelChoices

    def broken(logits: torch.Tensor, *, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("no kernel image for this device")

    logits = torch.randn(3, 50)
    kernels = KernelChoices(greedy=broken)
    assert kernels.greedy_sample(logits) is None
    assert kernels.greedy is None  # dropped: the torch ops from now on
    worked = KernelChoices(greedy=broken, greedy_worked=True)
    with pytest.raises(RuntimeError, match="no kernel image"):
        worked.greedy_sample(logits)
