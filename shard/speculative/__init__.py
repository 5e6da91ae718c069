"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling"): a cheap proposer guesses the next tokens of each decoding
row, and one target forward over each row's last token and its guesses verifies them
all at once.

- :mod:`shard.speculative.ngram`: prompt lookup (n-gram) proposals, no extra model;
- :mod:`shard.speculative.draft`: a draft model's guesses;
- :mod:`shard.speculative.rejection`: the acceptance rule for proposals that come with
  a draft distribution (a draft model);
- :mod:`shard.speculative.step`: the verify step over the rows the shard holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shard.requests import RequestState


class Proposer(Protocol):
    """Guesses the tokens that follow each decoding row.

    A proposer reads a row's tokens (``RequestState.token_ids``: prompt + generated,
    ending with the last sampled token, whose K/V are not cached yet) and may keep its
    own per-request state in ``RequestState.proposer_state``.
    """

    def propose(self, requests: Sequence[RequestState], budgets: Sequence[int]
                ) -> list[list[int]]:
        """At most ``budgets[i]`` token ids to follow ``requests[i]``'s last token (fewer,
        or none, when it has no guess)."""
        ...

    def draft_probs(self) -> Sequence[Sequence[torch.Tensor]] | None:
        """The distribution each guess of the last proposal was drawn from, per row
        ([vocab] float32 per guess; empty for a row whose guesses are deterministic),
        or None when every guess is (n-gram)."""
        ...
