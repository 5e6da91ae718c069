"""The verify step of speculative decoding over the rows a shard holds.

A speculative Decode (``DecodeStep.num_speculative_tokens`` k > 0) asks the proposer
for up to k guesses after each row's last token, runs one target forward over each
row's last token and its m_i guesses (m_i + 1 query tokens per row against the paged
cache, laid out as a decode step of one row per query token:
:meth:`SpeculativeDecoder.verify_logits`), and samples every position as a plain
Decode would sample it at that point of the sequence: position j of a row with the
parameters, seed step, penalties and alternatives it would have after the first j
guesses. The row keeps the longest run of guesses that equal the target's own tokens,
plus the target's token after them.

Greedy rows therefore emit exactly what decoding without speculation emits. For a
sampled row the guesses are deterministic (the draft distribution q is one token), and
"sample t_j from the target's p_j, accept the guess iff t_j equals it" is the rule of
Leviathan et al. 2023 / Chen et al. 2023 for such q: the guess is accepted with
probability p_j(d_j) = min(1, p/q), and on a rejection t_j is a draw from p_j without
d_j, i.e. from norm(max(0, p_j - q_j)). Since each position's noise depends only on
(seed, step), a seeded row emits the same tokens with and without speculation.

K/V are written for every guess; those of rejected guesses lie beyond the row's new
length and are overwritten by later steps (the router counts blocks for the longest
outcome, so nothing is written outside the row's blocks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shard.decode_state import DecodeRows
from shard.host_copy import to_device
from shard.pending_step import StepTimer
from shard.records import DecodeStep, Generation, StepOutput, TopToken
from shard.requests import RequestState
from shard.sampling import (
    SamplerOutput,
    SamplingRow,
    TokenMask,
    TokenSuffix,
    sample,
    sample_greedy,
)
from shard.speculative import Proposer

if TYPE_CHECKING:
    from shard.model_runner import ModelRunner


class SpeculativeDecoder:
    """Runs speculative Decode steps for ``runner`` with ``proposer``'s guesses.

    Args:
        runner: the model runner whose rows step.
        proposer: where the guesses come from.
    """

    def __init__(self, runner: ModelRunner, proposer: Proposer) -> None:
        self.runner = runner
        self.proposer = proposer

    @torch.inference_mode()
    def run(self, step: DecodeStep) -> StepOutput | None:
        """One speculative step over every decoding row (the step's finished ids and
        block appends already applied); None when the proposer has no guess for any
        row: the caller runs a plain decode step instead (a CUDA graph where one holds
        the batch).

        The host waits for the previous step first (the guesses read each row's
        tokens), and for this step's tokens before returning.
        """
        runner = self.runner
        table = runner.requests
        rows = list(table.decoding)
        runner.chain.wait_last()
        drafts = self.proposer.propose(rows, _budgets(step, rows))
        mask = None
        if table.kind.has_grammar:  # guesses a grammar refuses are cut
            mask, drafts = runner.grammars.draft_mask([r.grammar for r in rows], drafts,
                                                      runner.device)
        if not any(drafts):
            return None
        t0 = time.perf_counter_ns()
        timer = StepTimer(runner.device)
        logits = self.verify_logits(rows, drafts)
        out = self._sample(logits, rows, drafts, mask)
        timer.stop()
        runner.chain.last_timer = timer
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = None if out.top_token_ids is None else out.top_token_ids.tolist()
        top_lps = None if out.top_logprobs is None else out.top_logprobs.tolist()
        generations: list[Generation] = []
        counts: list[int] = []
        start = 0
        for r, d in zip(rows, drafts, strict=True):
            target = tokens[start : start + len(d) + 1]
            accepted = 0
            while accepted < len(d) and target[accepted] == d[accepted]:
                accepted += 1
            for p in range(start, start + accepted + 1):
                top: tuple[TopToken, ...] = ()
                if r.top_n_tokens and top_ids is not None and top_lps is not None:
                    top = tuple(
                        map(TopToken, top_ids[p][: r.top_n_tokens], top_lps[p][: r.top_n_tokens])
                    )
                generations.append(Generation(r.request_id, tokens[p], logprobs[p], top))
                r.append_token(tokens[p])
            counts.append(accepted + 1)
            start += len(d) + 1
        assert table.rows is not None
        table.rows.advance_by([r.last_token for r in rows], counts)
        failures = tuple(
            (r.request_id, failure)
            for r in rows
            if r.grammar is not None and (failure := r.grammar.failure) is not None
        )
        elapsed = (
            timer.elapsed_ns() if runner.device.type == "cuda" else (time.perf_counter_ns() - t0)
        )
        return StepOutput(
            tuple(generations),
            elapsed,
            failures,
            num_tokens=tuple(counts),
            num_proposed=tuple(len(d) for d in drafts),
        )

    def verify_logits(
        self, rows: Sequence[RequestState], drafts: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Logits [sum(len(d) + 1), vocab] of each row's last token and guesses, row
        after row (the model's dtype from a CUDA graph, float32 from the eager forward).

        The step is a decode step over one row per query token: row (i, j) holds guess
        j of row i (j = 0: its last token) at position ``seq_len_i + j``, with row i's
        block table, and attends to the ``seq_len_i + j + 1`` tokens up to itself. Each
        layer writes the K/V of all rows before it attends, so a guess sees the guesses
        before it; and a decode step of B(k + 1) rows replays the decode CUDA graphs
        captured for that batch (at small batches it costs about what a step of B rows
        costs: the weights are read once).
        """
        runner = self.runner
        state = runner.requests.rows
        assert state is not None
        device = state.tokens.device
        owner = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
        index = to_device(owner, torch.int64, device)
        tokens = [t for r, d in zip(rows, drafts, strict=True) for t in (r.last_token, *d)]
        offsets = [j for d in drafts for j in range(len(d) + 1)]
        expanded = DecodeRows(
            tokens=to_device(tokens, torch.int64, device),
            seq_lens=state.seq_lens.index_select(0, index)
            + to_device(offsets, torch.int32, device),
            block_tables=state.block_tables.index_select(0, index),
        )
        max_seqlen_k = max(r.seq_len + len(d) for r, d in zip(rows, drafts, strict=True)) + 1
        return runner.decode_logits(expanded, max_seqlen_k)

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[RequestState],
        drafts: Sequence[Sequence[int]], mask: TokenMask | None,
    ) -> SamplerOutput:
        """The target's token at every position ([sum(len(d) + 1), vocab] logits, row
        after row): position j of a row is sampled as a Decode would sample it after
        the row's first j guesses (seed step, penalties' token history, grammar state:
        ``mask``, see :meth:`~shard.grammar.GrammarCompiler.draft_mask`)."""
        positions = sum(len(d) + 1 for d in drafts)
        if all(r.plain_greedy for r in rows):
            return sample_greedy(logits, mask, self.runner.kernels)
        expanded: list[SamplingRow] = []
        for r, d in zip(rows, drafts, strict=True):
            for j in range(len(d) + 1):
                seen: Sequence[int] = r.token_ids if j == 0 else [*r.token_ids, *d[:j]]
                generated = TokenSuffix(seen, r.num_generated + j)
                expanded.append(
                    SamplingRow(r.sampling, r.num_generated + j, seen, generated, r.top_n_tokens)
                )
        assert len(expanded) == positions
        return sample(logits, expanded, mask)


def _budgets(step: DecodeStep, rows: Sequence[RequestState]) -> list[int]:
    """Most guesses per row: the step's ``num_speculative_tokens``, or a cached request's
    ``num_tokens`` - 1."""
    bound = {c.request_id: c.num_tokens - 1 for c in step.cached_requests if c.num_tokens}
    k = step.num_speculative_tokens
    return [bound.get(r.request_id, k) for r in rows]
