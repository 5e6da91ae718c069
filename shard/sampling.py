"""Token sampling, vectorized over the batch with per-row parameters.

Pipeline per step (all rows at once, each with its own parameters):

1. ``logprobs = log_softmax(raw logits)``: NOTE the reported logprob of a token (and of
   the top-n alternatives) is under the *model's* distribution, before penalties,
   temperature and truncation, so it does not depend on sampling settings (as in TGI).
2. penalties: repetition (HF, over prompt + generated), then frequency / presence
   (OpenAI, over generated tokens) — see :mod:`shard.penalties`; then the grammar's
   token mask (:class:`TokenMask`) of constrained rows: disallowed tokens get -inf.
3. greedy rows (``do_sample=False``): argmax of the penalized logits.
4. sampled rows: temperature → top-k → top-p → min-p → typical-p (Hugging Face's warper
   order), then an exponential race ``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn
   from ``(seed, step)`` only (:func:`exponential_noise`; on CUDA a counter-based hash
   over all rows at once), so a seeded row is reproducible whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import overload

import torch

from shard.host_copy import to_device
from shard.kernels.choices import KernelChoices
from shard.penalties import apply_frequency_presence_penalties, apply_repetition_penalty
from shard.sampling_types import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling call.

    Attributes:
        params: the request's parameters.
        step: index of the token being generated (0 for the first), mixed into the seed.
        seen_tokens: prompt + generated token ids (repetition penalty).
        generated_tokens: generated token ids (frequency / presence penalties).
        top_n: number of alternatives to return (0 = none).
    """

    params: SamplingParams
    step: int = 0
    seen_tokens: Sequence[int] = field(default_factory=tuple)
    generated_tokens: Sequence[int] = field(default_factory=tuple)
    top_n: int = 0


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens.

    Attributes:
        token_ids: [batch] int64.
        logprobs: [batch] float32, log_softmax of the raw logits at token_ids.
        top_token_ids: [batch, max_top_n] int64 (most likely first) or None when no
            row asked for alternatives; row i's first ``rows[i].top_n`` are meaningful.
        top_logprobs: [batch, max_top_n] float32 or None, matching top_token_ids.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass(frozen=True)
class TokenMask:
    """Tokens allowed for some rows of a batch (grammar-constrained decoding).

    Attributes:
        rows: [n] int64, indices of the constrained rows in the batch.
        allowed: [n, vocab] bool, True where the token is allowed for that row.
    """

    rows: torch.Tensor
    allowed: torch.Tensor

    def apply(self, scores: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``scores`` ([batch, vocab] float32) with disallowed tokens of the constrained
        rows at -inf; the other rows are unchanged. A copy unless ``inplace``."""
        masked = scores if inplace else scores.clone()
        masked[self.rows] = scores[self.rows].masked_fill(~self.allowed, float("-inf"))
        return masked

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks ([batch] int64) of ``logits`` ([batch, vocab]) under the mask;
        only the constrained rows are copied."""
        token_ids = logits.argmax(dim=-1)
        picked = logits[self.rows].masked_fill(~self.allowed, float("-inf")).argmax(dim=-1)
        return token_ids.index_copy(0, self.rows, picked)


def row_seed(seed: int, step: int) -> int:
    """63-bit generator seed from (seed, step) with SplitMix64 (Steele et al. 2014)."""
    x = (seed ^ ((step + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def _param(
    rows: Sequence[SamplingRow], name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return to_device([getattr(r.params, name) for r in rows], dtype, device)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the boundary kept); 0 = off.
    logits [batch, vocab] float32, top_k [batch] int64."""
    vocab = logits.shape[-1]
    k = top_k.clamp(max=vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
    drop = (logits < kth) & (k > 0)[:, None]
    return logits.masked_fill(drop, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2019): keep the most likely tokens until their
    mass reaches top_p (the token that crosses it is kept). top_p [batch]; 1.0 = off."""
    probs_sorted, idx = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p filter (Nguyen et al. 2024): drop p < min_p × max p. min_p [batch]; 0 = off."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(drop, float("-inf"))


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical filter (Meister et al. 2022), with Hugging Face's tie rules.
    typical_p [batch]; 1.0 = off."""
    logp = logits.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    shifted_sorted, idx = shifted.sort(dim=-1)
    cum = logits.gather(1, idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < typical_p[:, None]).sum(dim=1).clamp(max=logits.shape[-1] - 1)
    drop_sorted = shifted_sorted > shifted_sorted.gather(1, last[:, None])
    drop_sorted[:, 0] = False
    drop_sorted &= (typical_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _signed64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[batch, vocab] float32 Exp(1) noise from one int64 key per row, all rows at once.

    Counter-based: element (i, j) is SplitMix64 (Steele et al. 2014) of
    ``keys[i] + (j + 1) × golden`` (wrapping int64 arithmetic), whose top 53 bits give
    ``u`` in (0, 1) and ``E = -log(u)``. A dozen elementwise kernels whatever the batch,
    where a generator per row costs a seeding and a launch per row.

    Args:
        keys: [batch] int64.
        vocab: Columns.
    """
    counter = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    z = keys[:, None] + counter[None, :]
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    uniform = (_shr(z, 11).to(torch.float64) + 0.5) * 2.0**-53
    return (-torch.log(uniform)).to(torch.float32).clamp_min_(torch.finfo(torch.float32).tiny)


def exponential_noise(
    rows: Sequence[SamplingRow], vocab: int, device: torch.device
) -> torch.Tensor:
    """[batch, vocab] float32 Exp(1) noise; row i depends only on (seed_i, step_i).

    On CUDA: :func:`counter_noise` keyed by :func:`row_seed` (no per-row work on the
    host). Elsewhere: one ``torch.Generator`` per row seeded the same way (cheaper on a
    CPU than the 64-bit hash over the whole vocabulary).
    """
    seeds = [row_seed(r.params.seed, r.step) for r in rows]
    if device.type == "cuda":
        return counter_noise(to_device(seeds, torch.int64, device), vocab)
    noise = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
    for i, seed in enumerate(seeds):
        noise[i].exponential_(generator=torch.Generator(device=device).manual_seed(seed))
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _warp(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature and truncation for sampled rows. logits [n, vocab] float32."""
    dev = logits.device
    logits = logits / _param(rows, "temperature", torch.float32, dev)[:, None]
    # Each filter is a no-op for rows where it is off: skip the full-vocabulary sorts
    # when no row of the batch uses it (decided on the host, no device sync).
    if any(r.params.top_k > 0 for r in rows):
        logits = apply_top_k(logits, _param(rows, "top_k", torch.int64, dev))
    if any(r.params.top_p < 1.0 for r in rows):
        logits = apply_top_p(logits, _param(rows, "top_p", torch.float32, dev))
    if any(r.params.min_p > 0.0 for r in rows):
        logits = apply_min_p(logits, _param(rows, "min_p", torch.float32, dev))
    if any(r.params.typical_p < 1.0 for r in rows):
        logits = apply_typical_p(logits, _param(rows, "typical_p", torch.float32, dev))
    return logits


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None
) -> SamplerOutput:
    """Pick one token per row (see the module docstring for the pipeline).

    Args:
        logits: [batch, vocab] raw model logits, float32 or the model's dtype (a decode
            graph's output; cast to float32 here).
        rows: one :class:`SamplingRow` per logits row.
        mask: the allowed tokens of grammar-constrained rows (logprobs stay those of
            the unmasked distribution).

    Returns:
        :class:`SamplerOutput`.
    """
    assert logits.shape[0] == len(rows), (
        f"{logits.shape[0]} logits rows for {len(rows)} sampling rows"
    )
    dev = logits.device
    logits = logits.to(torch.float32)
    logprobs_all = logits.log_softmax(dim=-1)
    scores = _scores(logits, rows, mask)
    token_ids = scores.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if r.params.do_sample]
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        sub_scores = scores if len(sampled) == len(rows) else scores[sampled]
        probs = _warp(sub_scores, sub_rows).softmax(dim=-1)
        noise = exponential_noise(sub_rows, logits.shape[-1], dev)
        picked = (probs / noise).argmax(dim=-1)
        if len(sampled) == len(rows):
            token_ids = picked
        else:
            token_ids[sampled] = picked
    token_logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
    max_top_n = max((r.top_n for r in rows), default=0)
    top_ids = top_lp = None
    if max_top_n > 0:
        top_lp, top_ids = logprobs_all.topk(min(max_top_n, logits.shape[-1]), dim=-1)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_lp)


def _scores(logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None
            ) -> torch.Tensor:
    """``logits`` (float32) with the rows' penalties and the grammar ``mask`` applied:
    what the greedy argmax and the warpers read."""
    dev = logits.device
    # Penalties are applied only when a row asks for one, decided on the host: the
    # common batch (no penalties) builds no tensors and never waits for the device.
    scores = logits
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        scores = apply_repetition_penalty(
            scores,
            _param(rows, "repetition_penalty", torch.float32, dev),
            [r.seen_tokens for r in rows],
        )
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows):
        scores = apply_frequency_presence_penalties(
            scores,
            _param(rows, "frequency_penalty", torch.float32, dev),
            _param(rows, "presence_penalty", torch.float32, dev),
            [r.generated_tokens for r in rows],
        )
    if mask is not None:
        # the penalties made a new tensor, which can be masked in place
        scores = mask.apply(scores, inplace=scores is not logits)
    return scores


def sampling_probs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None
) -> torch.Tensor:
    """The distribution :func:`sample` draws a sampled row's token from: [n, vocab]
    float32, after the penalties, the grammar ``mask``, temperature and truncation (the
    target's p and a draft's q of speculative sampling, warped alike).

    Args:
        logits: [n, vocab] raw logits (float32 or the model's dtype).
        rows: one :class:`SamplingRow` per logits row, each with ``do_sample``.
        mask: the allowed tokens of grammar-constrained rows.
    """
    scores = _scores(logits.to(torch.float32), rows, mask)
    return _warp(scores, rows).softmax(dim=-1)


def has_penalty(params: SamplingParams) -> bool:
    """Whether a repetition, frequency or presence penalty is on (they read the tokens
    seen so far)."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def is_plain_greedy(params: SamplingParams) -> bool:
    """Argmax of the raw logits: greedy with no penalty (see :func:`sample_greedy`)."""
    return not params.do_sample and not has_penalty(params)


def sample_greedy(logits: torch.Tensor, mask: TokenMask | None = None,
                  kernels: KernelChoices | None = None) -> SamplerOutput:
    """:func:`sample` for a batch whose rows are all :func:`is_plain_greedy` and ask for
    no alternatives: argmax, and its logprob as ``logit - logsumexp(logits)`` (no full
    log_softmax, no per-row host work).

    Args:
        logits: [batch, vocab] raw model logits.
        mask: as for :func:`sample` (the argmax is over the allowed tokens, the logprob
            under the unmasked distribution).
        kernels: the runner's kernel choices.

    On CUDA without a mask, where ``kernels`` has it, one Triton kernel reads the logits
    once (:func:`shard.kernels.greedy.greedy`, through
    :meth:`~shard.kernels.choices.KernelChoices.greedy_sample`); this function's torch
    ops are its reference, and its path wherever the kernel cannot run.
    """
    if kernels is not None and mask is None and logits.is_cuda and logits.stride(-1) == 1:
        found = kernels.greedy_sample(logits)
        if found is not None:
            return SamplerOutput(found[0], found[1], None, None)
    logits = logits.to(torch.float32)
    token_ids = logits.argmax(dim=-1) if mask is None else mask.argmax(logits)
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1)
    return SamplerOutput(token_ids, chosen - logits.logsumexp(dim=-1), None, None)


class TokenSuffix(SequenceABC[int]):
    """The last ``n`` of ``tokens`` as a read-only sequence, without copying them (a
    decode step builds one per request; only the penalties read it)."""

    def __init__(self, tokens: Sequence[int], n: int) -> None:
        self._tokens = tokens
        self._start = len(tokens) - n

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return list(self)[index]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._tokens[self._start + index % len(self)]

    def __iter__(self) -> Iterator[int]:
        for i in range(self._start, len(self._tokens)):
            yield self._tokens[i]
