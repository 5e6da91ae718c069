"""Sampling one step's tokens from its logits, for the requests the shard holds: the
grammar masks, the greedy fast path, and the wait for the previous step that grammar
states and penalties need (:class:`StepSampler`)."""

from __future__ import annotations

import torch

from shard.grammar import GrammarCompiler
from shard.kernels.choices import KernelChoices
from shard.pending_step import StepChain
from shard.requests import BatchKind, RequestState
from shard.sampling import SamplerOutput, SamplingRow, TokenSuffix, sample, sample_greedy


class StepSampler:
    """Samples the tokens of a launched step.

    Args:
        grammars: builds the token masks of constrained requests.
        kernels: our kernels (the greedy sampling kernel).
        chain: the steps launched and not read yet (waited for when a row needs the
            previous step's tokens on the host).
    """

    def __init__(self, grammars: GrammarCompiler, kernels: KernelChoices,
                 chain: StepChain) -> None:
        self.grammars = grammars
        self.kernels = kernels
        self.chain = chain

    def sample(self, logits: torch.Tensor, requests: list[RequestState],
               rows: BatchKind | None) -> SamplerOutput:
        """One token per request from ``logits`` [len(requests), vocab] (float32 or the
        model's dtype). ``rows``: the :class:`BatchKind` of the decoding rows among
        ``requests`` (all of them, or a mixed step's leading ones), whose grammar
        states and penalties need the previous step's tokens; None when none is a row.

        NOTE: the forward is already queued on the device when the host waits here for
        the previous step: it fills the grammar masks while the device computes.

        Raises:
            RuntimeError: the previous step was not finished within 120 s.
        """
        prompts = [r for r in requests if not r.decoding]
        mask = None
        if (rows is not None and rows.has_grammar) or any(
                r.grammar is not None for r in prompts):
            if rows is not None and rows.has_grammar:
                self.chain.wait_last()
            mask = self.grammars.token_mask([r.grammar for r in requests], logits.device)
        if (rows is None or rows.plain_greedy) and all(r.plain_greedy for r in prompts):
            return sample_greedy(logits, mask, self.kernels)
        if rows is not None and rows.has_penalty:
            self.chain.wait_last()  # penalties read the host's token history
        return sample(logits, [sampling_row(r) for r in requests], mask)


def sampling_row(r: RequestState) -> SamplingRow:
    """``r``'s row of a sampling call: its parameters, step, and token history."""
    generated = TokenSuffix(r.token_ids, r.num_generated)
    return SamplingRow(r.sampling, r.num_generated, r.token_ids, generated, r.top_n_tokens)
