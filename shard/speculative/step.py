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
    sampling_probs,
)
from shard.speculative import Proposer
from shard.speculative.rejection import accept_drafts, speculative_randoms

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
        started = time.perf_counter_ns()
        drafts = self.proposer.propose(rows, _budgets(step, rows))
        mask = None
        if table.kind.has_grammar:  # guesses a grammar refuses are cut
            mask, drafts = runner.grammars.draft_mask([r.grammar for r in rows], drafts,
                                                      runner.device)
        if not any(drafts):
            return None
        # NOTE: the host has the guesses: a draft model's steps are done on the device
        propose_ns = time.perf_counter_ns() - started
        t0 = time.perf_counter_ns()
        timer = StepTimer(runner.device)
        logits = self.verify_logits(rows, drafts)
        out = self._sample(logits, rows, drafts, mask)
        ruled = self._apply_rule(logits, rows, drafts, self.proposer.draft_probs())
        timer.stop()
        runner.chain.last_timer = timer
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = None if out.top_token_ids is None else out.top_token_ids.tolist()
        top_lps = None if out.top_logprobs is None else out.top_logprobs.tolist()
        generations: list[Generation] = []
        counts: list[int] = []
        start = 0
        for i, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            target = tokens[start : start + len(d) + 1]
            accepted = 0
            while accepted < len(d) and target[accepted] == d[accepted]:
                accepted += 1
            if i in ruled:  # a sampled row with a draft distribution: the rule's tokens
                emitted, emitted_logprobs = ruled[i]
                accepted = len(emitted) - 1
                tokens[start : start + accepted + 1] = emitted
                logprobs[start : start + accepted + 1] = emitted_logprobs
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
            propose_ns + elapsed,
            failures,
            num_tokens=tuple(counts),
            num_proposed=tuple(len(d) for d in drafts),
            propose_ns=propose_ns,
        )

    def _apply_rule(
        self, logits: torch.Tensor, rows: Sequence[RequestState],
        drafts: Sequence[Sequence[int]], draft_probs: Sequence[Sequence[torch.Tensor]] | None,
    ) -> dict[int, tuple[list[int], list[float]]]:
        """The tokens (and their logprobs under the model) of each sampled row whose
        guesses come with their draft distributions (a draft model), by the rule of
        Leviathan et al. 2023 (:func:`~shard.speculative.rejection.accept_drafts`):
        row index -> (emitted tokens, logprobs). Greedy rows and deterministic guesses
        keep the target's own tokens (accepted while they equal the guesses)."""
        if not draft_probs:
            return {}
        picked = [i for i, d in enumerate(drafts) if d and draft_probs[i]]
        if not picked:
            return {}
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        positions = [starts[i] + j for i in picked for j in range(len(drafts[i]) + 1)]
        sampling = []
        for i in picked:
            r, d = rows[i], drafts[i]
            for j in range(len(d) + 1):
                seen: Sequence[int] = r.token_ids if j == 0 else [*r.token_ids, *d[:j]]
                sampling.append(SamplingRow(r.sampling, r.num_generated + j, seen,
                                            TokenSuffix(seen, r.num_generated + j)))
        index = to_device(positions, torch.int64, logits.device)
        p_flat = sampling_probs(logits.index_select(0, index), sampling)
        k = max(len(drafts[i]) for i in picked)
        vocab = p_flat.shape[1]
        device = p_flat.device
        p = torch.zeros(len(picked), k + 1, vocab, dtype=torch.float32, device=device)
        q = torch.zeros(len(picked), k, vocab, dtype=torch.float32, device=device)
        guesses = torch.zeros(len(picked), k, dtype=torch.int64)
        offset = 0
        for n, i in enumerate(picked):
            m = len(drafts[i])
            p[n, : m + 1] = p_flat[offset : offset + m + 1]
            q[n, :m] = torch.stack(list(draft_probs[i]))
            guesses[n, :m] = torch.tensor(drafts[i])
            offset += m + 1
        uniforms, noise = speculative_randoms(
            [rows[i].sampling.seed for i in picked], [rows[i].num_generated for i in picked],
            k, vocab, device)
        emitted, accepted = accept_drafts(
            guesses.to(device), to_device([len(drafts[i]) for i in picked], torch.int64, device),
            p, q, uniforms, noise)
        raw = logits.index_select(0, index).float().log_softmax(dim=-1)
        out: dict[int, tuple[list[int], list[float]]] = {}
        offset = 0
        for n, i in enumerate(picked):
            tokens = emitted[n, : int(accepted[n]) + 1].tolist()
            out[i] = (tokens, [float(raw[offset + j, t]) for j, t in enumerate(tokens)])
            offset += len(drafts[i]) + 1
        return out

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
