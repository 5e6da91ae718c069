"""The acceptance rule of speculative sampling: the emitted tokens are distributed as
the target's (a chi-square test on a tiny vocabulary, which must also catch the rule
broken on purpose), a draft equal to the target is always accepted, deterministic
guesses reproduce seeded non-speculative sampling, and the randoms are keyed by
(seed, step)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shard.sampling import SamplingParams, SamplingRow, apply_top_k, exponential_noise, sample
from shard.speculative import rejection
from shard.speculative.rejection import accept_drafts, speculative_randoms

CPU = torch.device("cpu")
VOCAB = 5
K = 3
TRIALS = 60_000
# chi-square p-value below which the emitted distribution is declared not the target's
P_VALUE = 1e-6

Accept = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def chain_tables(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token tables [prev, next] (float32, rows sum to 1), each
    probability at least 0.2 / vocab so every expected count is large."""

    def table() -> torch.Tensor:
        raw = torch.rand(vocab, vocab, generator=gen, dtype=torch.float64) ** 3
        mixed = 0.8 * raw / raw.sum(dim=1, keepdim=True) + 0.2 / vocab
        return mixed.to(torch.float32)

    return table(), table()


def speculate(
    accept: Accept,
    target: torch.Tensor,
    draft: torch.Tensor | None,
    prev: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify step for rows whose last token is ``prev`` [M]: up to K guesses
    drawn from the draft table one after the other (from the target table when
    ``draft`` is None, passed as deterministic guesses), a random count of them kept."""
    rows = prev.shape[0]
    chooser = target if draft is None else draft
    guesses, context = [], [prev]
    for _ in range(K):
        guesses.append(torch.multinomial(chooser[context[-1]], 1, generator=gen).squeeze(1))
        context.append(guesses[-1])
    draft_token_ids = torch.stack(guesses, dim=1)
    history = torch.stack(context, dim=1)  # [M, K + 1]: the token before each position
    num_drafts = torch.randint(0, K + 1, (rows,), generator=gen)
    uniforms = torch.rand(rows, K, generator=gen).clamp_(min=1e-7)
    noise = torch.empty(rows, K + 1, VOCAB).exponential_(generator=gen)
    draft_probs = None if draft is None else draft[history[:, :K]]
    return accept(draft_token_ids, num_drafts, target[history], draft_probs, uniforms, noise)


def first_two_tokens_p_value(accept: Accept, deterministic: bool = False) -> float:
    """Chi-square p-value of the first two emitted tokens' joint counts over TRIALS
    sequences (a second step for those whose first step emitted one token) against
    the target chain's exact distribution target[0, a] × target[a, b]."""
    gen = torch.Generator().manual_seed(1234)
    target, draft = chain_tables(gen, VOCAB)
    table = None if deterministic else draft
    start = torch.zeros(TRIALS, dtype=torch.int64)
    token_ids, num_accepted = speculate(accept, target, table, start, gen)
    first, second = token_ids[:, 0], token_ids[:, 1].clone()
    again = num_accepted == 0
    more, _ = speculate(accept, target, table, first[again], gen)
    second[again] = more[:, 0]
    observed = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB)
    expected = (target[0][:, None] * target).flatten().to(torch.float64) * TRIALS
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((VOCAB * VOCAB - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def test_emitted_tokens_follow_the_target() -> None:
    assert first_two_tokens_p_value(accept_drafts) > P_VALUE


def test_deterministic_guesses_emit_the_target_distribution() -> None:
    assert first_two_tokens_p_value(accept_drafts, deterministic=True) > P_VALUE


def test_chi_square_catches_a_residual_drawn_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    assert first_two_tokens_p_value(accept_drafts) < P_VALUE


def test_chi_square_catches_always_accepting() -> None:
    def always(
        ids: torch.Tensor,
        num: torch.Tensor,
        p: torch.Tensor,
        q: torch.Tensor | None,
        uniforms: torch.Tensor,
        noise: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # u = 0 accepts every guess the target allows (every p here is > 0)
        return accept_drafts(ids, num, p, q, torch.zeros_like(uniforms), noise)

    assert first_two_tokens_p_value(always) < P_VALUE


def test_draft_equal_to_target_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 50
    probs = torch.rand(rows, K + 1, vocab, generator=gen).softmax(dim=-1)
    drafts = torch.multinomial(probs[:, :K].reshape(-1, vocab), 1, generator=gen).view(rows, K)
    num_drafts = torch.randint(0, K + 1, (rows,), generator=gen)
    uniforms = torch.rand(rows, K, generator=gen)
    noise = torch.empty(rows, K + 1, vocab).exponential_(generator=gen)
    token_ids, num_accepted = accept_drafts(
        drafts, num_drafts, probs, probs[:, :K].clone(), uniforms, noise
    )
    assert num_accepted.tolist() == num_drafts.tolist()
    for r in range(rows):
        n = int(num_drafts[r])
        assert token_ids[r, :n].tolist() == drafts[r, :n].tolist()
        # the bonus token is the race's draw from p after the guesses
        assert token_ids[r, n] == (probs[r, n] / noise[r, n]).argmax()


def warped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature and top-k as :func:`shard.sampling.sample` applies them, softmaxed.
    logits [R, V] float32."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    return apply_top_k(logits / temperature[:, None], top_k).softmax(dim=-1)


def seeded_rows() -> tuple[list[SamplingParams], list[int], torch.Tensor]:
    """Sampling parameters and first steps of 6 rows, and their logits [6, K + 1, 40]
    at each position."""
    params = [
        SamplingParams(do_sample=True, seed=seed, temperature=temperature, top_k=top_k)
        for seed, temperature, top_k in [
            (7, 1.0, 0),
            (7, 1.0, 0),
            (123, 0.7, 5),
            (2**40 + 3, 1.5, 0),
            (9, 0.5, 3),
            (11, 1.0, 0),
        ]
    ]
    steps = [0, 5, 3, 17, 1, 40]
    logits = torch.randn(len(params), K + 1, 40, generator=torch.Generator().manual_seed(5))
    return params, steps, logits


def test_deterministic_guesses_reproduce_seeded_sampling() -> None:
    """Each row's guesses equal the tokens plain sampling gives for its first m
    positions and then differ: the row emits exactly those m + 1 plain tokens."""
    params, steps, logits = seeded_rows()
    rows, vocab = logits.shape[0], logits.shape[2]
    plain = torch.stack(
        [
            sample(
                logits[:, j], [SamplingRow(p, s + j) for p, s in zip(params, steps, strict=True)]
            ).token_ids
            for j in range(K + 1)
        ],
        dim=1,
    )
    agree = [0, 3, 1, 2, 3, 0]  # guesses equal to the plain tokens before the first miss
    num_drafts = torch.tensor([2, 3, 3, 3, 2, 0])
    drafts = plain[:, :K].clone()
    for r, m in enumerate(agree):
        if m < K:
            drafts[r, m] = (plain[r, m] + 1) % vocab
    target_probs = torch.stack([warped_probs(logits[:, j], params) for j in range(K + 1)], dim=1)
    uniforms, noise = speculative_randoms([p.seed for p in params], steps, K, vocab, CPU)
    token_ids, num_accepted = accept_drafts(drafts, num_drafts, target_probs, None, uniforms, noise)
    expected_accepted = [min(m, int(n)) for m, n in zip(agree, num_drafts, strict=True)]
    assert num_accepted.tolist() == expected_accepted
    for r in range(rows):
        n = expected_accepted[r]
        assert token_ids[r, : n + 1].tolist() == plain[r, : n + 1].tolist()


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rows_without_guesses_emit_one_plain_sample(with_draft_probs: bool) -> None:
    params, steps, logits = seeded_rows()
    rows, vocab = logits.shape[0], logits.shape[2]
    plain = sample(logits[:, 0], [SamplingRow(p, s) for p, s in zip(params, steps, strict=True)])
    target_probs = torch.stack([warped_probs(logits[:, j], params) for j in range(K + 1)], dim=1)
    draft_probs = torch.full((rows, K, vocab), 1 / vocab) if with_draft_probs else None
    uniforms, noise = speculative_randoms([p.seed for p in params], steps, K, vocab, CPU)
    drafts = torch.zeros(rows, K, dtype=torch.int64)
    token_ids, num_accepted = accept_drafts(
        drafts, torch.zeros(rows, dtype=torch.int64), target_probs, draft_probs, uniforms, noise
    )
    assert num_accepted.tolist() == [0] * rows
    assert token_ids[:, 0].tolist() == plain.token_ids.tolist()


def test_no_guess_slots_at_all() -> None:
    """K = 0: every row emits its plain sample, with or without draft probabilities."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(4, 1, 9, generator=gen).softmax(dim=-1)
    noise = torch.empty(4, 1, 9).exponential_(generator=gen)
    empty_ids, empty_u = torch.zeros(4, 0, dtype=torch.int64), torch.zeros(4, 0)
    zeros = torch.zeros(4, dtype=torch.int64)
    for q in (None, torch.zeros(4, 0, 9)):
        token_ids, num_accepted = accept_drafts(empty_ids, zeros, probs, q, empty_u, noise)
        assert num_accepted.tolist() == [0] * 4
        assert token_ids[:, 0].tolist() == (probs[:, 0] / noise[:, 0]).argmax(dim=-1).tolist()


def test_randoms_are_keyed_by_seed_and_step() -> None:
    seeds, steps, vocab = [7, 7, 99, 2**62 + 1], [0, 2, 0, 30], 16
    uniforms, noise = speculative_randoms(seeds, steps, K, vocab, CPU)
    assert uniforms.shape == (4, K) and uniforms.dtype == torch.float32
    assert noise.shape == (4, K + 1, vocab) and noise.dtype == torch.float32
    for r, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        for j in range(K + 1):
            row = SamplingRow(SamplingParams(do_sample=True, seed=seed), step + j)
            assert torch.equal(noise[r, j], exponential_noise([row], vocab, CPU)[0])
    # row 1 starts two steps after row 0 (same seed): its positions are row 0's, shifted
    assert torch.equal(uniforms[1, :1], uniforms[0, 2:])
    assert torch.equal(noise[1, :2], noise[0, 2:])
    # the same in another batch, with another K
    alone_u, alone_noise = speculative_randoms([99], [0], K + 2, vocab, CPU)
    assert torch.equal(alone_u[0, :K], uniforms[2]) and torch.equal(
        alone_noise[0, : K + 1], noise[2]
    )
    # distinct (seed, step) pairs draw distinct numbers
    distinct = torch.cat([uniforms[0], uniforms[2], uniforms[3]]).tolist()
    assert len(set(distinct)) == len(distinct)


def test_uniforms_are_uniform() -> None:
    """16k uniforms (4k rows' 4 positions) in (0, 1), spread evenly over 20 bins
    (chi-square)."""
    rows = 4_000
    uniforms, _ = speculative_randoms(list(range(rows)), [3] * rows, 4, 1, CPU)
    assert float(uniforms.min()) > 0.0 and float(uniforms.max()) < 1.0
    observed = torch.histc(uniforms.double(), bins=20, min=0.0, max=1.0)
    expected = uniforms.numel() / 20
    statistic = ((observed - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor(19 / 2, dtype=torch.float64), statistic / 2)
    assert float(p_value) > P_VALUE
