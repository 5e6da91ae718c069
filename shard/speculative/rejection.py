"""Which guesses a row keeps: the acceptance rule of speculative sampling, vectorized
over padded rows, and the random numbers it reads, keyed by (seed, step) as
:mod:`shard.sampling` keys its own.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
(Algorithm 1); Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling" (Algorithm 2). A draft token d_j drawn from the draft's q_j is
accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the row's
token is drawn from norm(max(0, p_j - q_j)); when all of a row's guesses are accepted a
bonus token is drawn from p after them. The emitted tokens are then distributed exactly
as tokens sampled from the target p one at a time.

Every draw from a distribution is an exponential race, ``argmax(probs / E)`` with
``E ~ Exp(1)`` per token (as :func:`shard.sampling.sample` draws): the winner is
distributed as ``probs`` normalized, so unnormalized weights (the residual
``max(0, p - q)``) need no division by their sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard.host_copy import to_device
from shard.sampling import SamplingParams, SamplingRow, counter_noise, exponential_noise, row_seed

# NOTE: mixed into a row's seed for the acceptance uniforms, so that they are drawn
# from another stream than the row's sampling noise (an arbitrary odd 63-bit constant)
_UNIFORM_SALT = 0x2545F4914F6CDD1D
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def accept_drafts(
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row emits after verifying its guesses (Leviathan et al. 2023,
    Chen et al. 2023; see the module docstring).

    With ``draft_probs``: guess j is accepted iff ``uniforms[r, j] × q_j(d_j) <
    p_j(d_j)`` (probability min(1, p/q)); at the first rejection the token is drawn from
    max(0, p_j - q_j) (from p_j in the measure-zero case where that is all zero), after
    ``num_drafts[r]`` acceptances a bonus token from p at that position.

    Without (deterministic guesses, e.g. n-gram: q_j is one-hot at d_j): t_j is drawn
    from p_j at every position and guess j is accepted iff t_j == d_j; this is the
    same rule for a one-hot q (accepted with probability p_j(d_j); a rejected t_j is a
    draw from p_j without d_j, i.e. from norm(max(0, p_j - q_j))), and since position
    j's draw is the one :func:`shard.sampling.sample` makes with that noise, a row
    emits what non-speculative sampling emits. ``uniforms`` are not read.

    Args:
        draft_token_ids: [R, K] int64 guesses; row r's first ``num_drafts[r]`` are
            meaningful (the rest are padding, any token id).
        num_drafts: [R] int64 in [0, K].
        target_probs: [R, K + 1, V] float32, the target's distribution at each
            position (position j follows the row's first j guesses), already warped
            (temperature, top-k/p, min-p, penalties); each row sums to 1.
        draft_probs: [R, K, V] float32, the draft's distribution each guess was drawn
            from, warped the same way; or None for deterministic guesses.
        uniforms: [R, K] float32 in (0, 1) (:func:`speculative_randoms`).
        noise: [R, K + 1, V] float32 Exp(1) (:func:`speculative_randoms`).

    Returns:
        ``(token_ids, num_accepted)``: [R, K + 1] int64 and [R] int64; row r emits
        ``token_ids[r, : num_accepted[r] + 1]`` (its accepted guesses, then the token
        drawn at the first rejection or the bonus token); the entries after those are
        token ids of no meaning.
    """
    num_rows, k = draft_token_ids.shape
    assert target_probs.shape[:2] == (num_rows, k + 1), (
        f"target_probs {tuple(target_probs.shape)} for {num_rows} rows of {k} guesses"
    )
    assert noise.shape == target_probs.shape, (
        f"noise {tuple(noise.shape)} for target_probs {tuple(target_probs.shape)}"
    )
    guessed = torch.arange(k, device=num_drafts.device)[None, :] < num_drafts[:, None]
    if draft_probs is None:
        sampled = (target_probs / noise).argmax(dim=-1)
        accepted = guessed & (sampled[:, :k] == draft_token_ids)
        return sampled, _leading_true(accepted)
    assert draft_probs.shape == (num_rows, k, target_probs.shape[2]), (
        f"draft_probs {tuple(draft_probs.shape)} for target_probs {tuple(target_probs.shape)}"
    )
    guesses = draft_token_ids[:, :, None]
    p_guess = target_probs[:, :k].gather(2, guesses).squeeze(2)
    q_guess = draft_probs.gather(2, guesses).squeeze(2)
    # NOTE: strict, so that a guess the target rules out (p = 0) is never accepted,
    # even where q is 0 as well
    accepted = guessed & (uniforms * q_guess < p_guess)
    num_accepted = _leading_true(accepted)
    rows = torch.arange(num_rows, device=num_accepted.device)
    probs = target_probs[rows, num_accepted]  # [R, V], at each row's last position
    if k > 0:
        rejected = num_accepted < num_drafts
        residual = _residual(probs, draft_probs[rows, num_accepted.clamp(max=k - 1)])
        usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
        probs = torch.where(usable, residual, probs)
    last = (probs / noise[rows, num_accepted]).argmax(dim=-1)
    token_ids = torch.cat([draft_token_ids, last[:, None]], dim=1)
    token_ids[rows, num_accepted] = last
    return token_ids, num_accepted


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalized: what a row draws from at a rejection. [R, V]."""
    return (p - q).clamp_min(0.0)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[R] int64: the length of each row's leading run of True in ``mask`` [R, K]."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def speculative_randoms(
    seeds: Sequence[int], steps: Sequence[int], k: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers :func:`accept_drafts` reads, for rows with K guesses.

    Position j of row r is the token of step ``steps[r] + j`` (the index of the
    generated token, as :attr:`shard.sampling.SamplingRow.step`), so everything drawn
    for it depends only on ``(seeds[r], steps[r] + j)``, whatever the batch or K:

    - ``noise[r, j]`` is exactly :func:`shard.sampling.exponential_noise` for that row
      and step (deterministic guesses then reproduce non-speculative sampling);
    - ``uniforms[r, j]`` comes from :func:`shard.sampling.counter_noise` keyed by
      :func:`shard.sampling.row_seed` of the seed with a salt (another stream than
      the noise's): ``u = exp(-E)`` for ``E ~ Exp(1)``, kept inside (0, 1).

    Args:
        seeds: [R] each row's sampling seed.
        steps: [R] the step of each row's first position.
        k: guesses per row (K).
        vocab: V.
        device: where the tensors go.

    Returns:
        ``(uniforms, noise)``: [R, K] float32 and [R, K + 1, V] float32.
    """
    assert len(seeds) == len(steps), f"{len(seeds)} seeds for {len(steps)} steps"
    num_rows = len(seeds)
    rows: list[SamplingRow] = []
    for seed, step in zip(seeds, steps, strict=True):
        params = SamplingParams(seed=seed)
        rows.extend(SamplingRow(params, step + j) for j in range(k + 1))
    noise = exponential_noise(rows, vocab, device).view(num_rows, k + 1, vocab)
    keys = [
        row_seed(seed ^ _UNIFORM_SALT, step + j)
        for seed, step in zip(seeds, steps, strict=True)
        for j in range(k)
    ]
    uniforms = torch.exp(-counter_noise(to_device(keys, torch.int64, device), 1))
    uniforms = uniforms.view(num_rows, k)
    return uniforms.clamp_(max=_BELOW_ONE), noise
