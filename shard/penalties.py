"""Logit penalties over tokens already seen, vectorized over the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard.host_copy import to_device


def _row_token_index(
    token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row index, token id) pairs, both [n] int64."""
    rows = [i for i, toks in enumerate(token_lists) for _ in toks]
    toks = [t for toks in token_lists for t in toks]
    return (
        to_device(rows, torch.int64, device),
        to_device(toks, torch.int64, device),
    )


def apply_repetition_penalty(
    logits: torch.Tensor, penalties: torch.Tensor, seen_tokens: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Hugging Face / CTRL repetition penalty (Keskar et al. 2019, "CTRL").

    For every token that occurs in the row's prompt or generated tokens: a positive
    logit is divided by the penalty, a negative one multiplied by it. Penalty 1.0 = off.

    Args:
        logits: [batch, vocab] float32.
        penalties: [batch] float32, > 0.
        seen_tokens: per row, prompt + generated token ids.

    Returns:
        new logits [batch, vocab].
    """
    if bool((penalties == 1.0).all()):
        return logits
    rows, toks = _row_token_index(seen_tokens, logits.device)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[rows, toks] = True
    p = penalties[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    generated_tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """OpenAI frequency / presence penalties over generated tokens only:
    ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.

    Args:
        logits: [batch, vocab] float32.
        frequency: [batch] float32 (0.0 = off).
        presence: [batch] float32 (0.0 = off).
        generated_tokens: per row, the tokens generated so far.

    Returns:
        new logits [batch, vocab].
    """
    if bool(((frequency == 0.0) & (presence == 0.0)).all()):
        return logits
    rows, toks = _row_token_index(generated_tokens, logits.device)
    counts = torch.zeros_like(logits)
    counts.index_put_((rows, toks), torch.ones_like(toks, dtype=logits.dtype), accumulate=True)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
