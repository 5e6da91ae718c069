"""The draft model of speculative decoding (``--speculative-method draft``): a smaller
model with the served model's tokenizer, run in the same shard, guesses the next tokens
of each row one decode step at a time (Leviathan et al. 2023; Chen et al. 2023).

:class:`DraftModel` holds the draft's weights, its attention backend and its own paged
KV cache. The cache has as many blocks of the same size as the served model's, so the
router's block tables address both: a row's draft K/V for position p lie in the same
block and slot as its target K/V for p. Warm-up counts both caches in one block's bytes
and captures the draft's decode CUDA graphs beside the target's
(:class:`~shard.warmup.Warmup`).

:class:`DraftProposer` keeps each row's draft cache up to date lazily: the tokens the
draft has not computed (the target's token after the accepted guesses; a new request's
prompt, the tokens of steps without speculation) are computed before the row's first
guess (a few tokens as decode rows through the draft's CUDA graphs, more in one varlen
forward), then each further guess is one decode step. Plain greedy rows keep their
guesses on the device until the last step, so the steps launch back to back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shard.attention import AttentionSpec, select_backend
from shard.cuda_graphs import DecodeGraphs
from shard.decode_state import DecodeRows
from shard.host_copy import to_device
from shard.inputs import SeqChunk, build_inputs
from shard.kv_cache import KVCacheLayer, allocate_kv_cache, bytes_per_block
from shard.layers.tp_layout import check_tp_size, kv_heads_per_rank
from shard.model_loader import build_model
from shard.models.config import ModelConfig
from shard.quantization.config import resolve_kv_cache_dtype
from shard.requests import RequestState
from shard.sampling import SamplingRow, TokenSuffix, sample, sampling_probs
from shard.tokenizer_files import check_same_vocabulary

if TYPE_CHECKING:
    from shard.model_runner import ModelRunner

# Mixed into a row's seed for the draft's own sampling, so that its guesses are drawn
# independently of the target's noise (the acceptance rule needs d ~ q on its own).
DRAFT_SEED_SALT = 0x2545F4914F6CDD1D
# A row missing at most this many draft tokens catches up as decode rows (CUDA graphs),
# more through a varlen forward: after a verify step a row misses 1 or 2.
CATCH_UP_ROWS = 8


class DraftModel:
    """The draft model of one shard, beside ``runner``'s model.

    Args:
        runner: the served model's runner (device, dtype, kernels, block size, backend).

    Raises:
        ValueError: the draft's vocabulary differs from the served model's, its heads do
            not split over the shard's ranks, or its attention backend needs another
            block size.
    """

    def __init__(self, runner: ModelRunner) -> None:
        config = runner.config
        path = config.speculative_model
        check_same_vocabulary(Path(config.model_path), Path(path))
        mc = ModelConfig.from_pretrained(path)
        tp = config.world_size
        check_tp_size(mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size, tp)
        self.runner = runner
        self.model_config = mc
        spec = AttentionSpec(device=runner.device, dtype=runner.dtype,
                             num_heads=mc.num_attention_heads // tp,
                             num_kv_heads=kv_heads_per_rank(mc.num_key_value_heads, tp),
                             head_dim=mc.head_dim, block_size=config.block_size,
                             kv_cache_dtype=resolve_kv_cache_dtype(config, runner.dtype,
                                                                    runner.device))
        self.backend, _ = select_backend(runner.backend.name, spec, runner.kernels)
        if self.backend.kv_block_size(config.block_size) != runner.block_size:
            raise ValueError(f"--speculative-model: its attention needs KV blocks of "
                             f"{self.backend.kv_block_size(config.block_size)} tokens, the "
                             f"served model's {runner.block_size}")
        draft_config = dataclasses.replace(config, model_path=path, model_id="",
                                           speculative_method="none", speculative_model="")
        self.model = build_model(draft_config, mc, self.backend, runner.device, runner.dtype,
                                 runner.kernels)
        self.vocab_size = runner.model_config.vocab_size  # guesses are the target's ids
        self.kv_cache: list[KVCacheLayer] = []
        self.graphs: DecodeGraphs | None = None

    # ---- warm-up (shard.warmup.Warmup calls these beside the target's) ---------------

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """Bytes one block of the draft's cache takes on this rank."""
        return bytes_per_block(self.model_config, self.runner.block_size, kv_dtype,
                               self.runner.config.world_size)

    def bind(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """Allocate the draft's cache of ``num_blocks`` blocks and attach it."""
        self.unbind()
        fp8 = kv_dtype == torch.float8_e4m3fn  # token-major only
        runner = self.runner
        self.kv_cache = allocate_kv_cache(
            self.model_config, num_blocks, runner.block_size, kv_dtype, runner.device,
            runner.config.world_size,
            head_major=not fp8 and self.backend.kv_head_major(runner.device))
        for attn, cache in zip(self.model.attention_layers(), self.kv_cache, strict=True):
            attn.kv_cache = cache

    def unbind(self) -> None:
        """Release the draft's graphs and cache."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_cache = []

    def warm(self, chunks: Sequence[SeqChunk]) -> None:
        """The worst-case prefill through the draft (kernels compiled, memory measured)."""
        self.chunk_logits(chunks)

    def capture(self, buckets: Sequence[int], max_seqlen_k: int) -> None:
        """Capture the draft's decode forward for ``buckets`` over its bound cache."""
        runner = self.runner
        self.graphs = DecodeGraphs(self.model, self.backend, buckets, runner.block_size,
                                   max_seqlen_k, runner.device, runner.kernels)
        self.graphs.capture()

    # ---- forwards -----------------------------------------------------------------

    def chunk_logits(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Compute ``chunks`` into the draft's cache; logits [len(chunks), vocab] of each
        chunk's last token (float32)."""
        inputs = build_inputs(list(chunks), self.runner.block_size, True, self.runner.device)
        self.backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model.compute_logits(hidden[inputs.last_token_indices])

    def decode_logits(self, rows: DecodeRows, max_seqlen_k: int) -> torch.Tensor:
        """One decode step of ``rows`` on the draft: a graph replay when a captured bucket
        holds them, the eager forward otherwise; logits [len(rows), vocab]."""
        if self.graphs is not None and self.graphs.holds(len(rows), max_seqlen_k):
            return self.graphs.run(rows)
        inputs = rows.model_inputs(self.runner.block_size, max_seqlen_k)
        self.backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model.compute_logits(hidden)


@dataclass
class DraftState:
    """What the draft computed for a row (``RequestState.proposer_state``): the K/V of
    its first ``start`` tokens, then of ``fed`` (guesses, which hold only where the row's
    tokens agree with them)."""

    start: int
    fed: tuple[int, ...]

    def valid(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` whose draft K/V are right."""
        n = self.start
        for guess in self.fed:
            if n >= len(token_ids) or token_ids[n] != guess:
                break
            n += 1
        return min(n, len(token_ids) - 1)


class DraftProposer:
    """Guesses from a :class:`DraftModel`, sampled as the target would sample (greedy
    rows: the argmax with the row's penalties; sampled rows: from the draft's
    distribution q warped with the row's parameters, which :meth:`draft_probs` keeps for
    the acceptance rule). Rows constrained by a grammar get no guesses.

    Args:
        draft: the draft model.
    """

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self._probs: list[list[torch.Tensor]] = []

    def draft_probs(self) -> list[list[torch.Tensor]] | None:
        """The last proposal's q per row: one [vocab] float32 tensor per guess of a sampled
        row, none for a greedy one."""
        return self._probs

    @torch.inference_mode()
    def propose(self, requests: Sequence[RequestState], budgets: Sequence[int]
                ) -> list[list[int]]:
        """See :class:`shard.speculative.Proposer`."""
        guesses: list[list[int]] = [[] for _ in requests]
        self._probs = [[] for _ in requests]
        alive = [i for i, (r, b) in enumerate(zip(requests, budgets, strict=True))
                 if b > 0 and r.grammar is None]
        if not alive:
            return guesses
        logits = self._catch_up([requests[i] for i in alive], alive)
        for i in alive:  # the draft now holds every token of the row but its guesses
            requests[i].proposer_state = DraftState(len(requests[i].token_ids), ())
        if all(requests[i].plain_greedy for i in alive):
            self._greedy(logits, requests, budgets, alive, guesses)
            return guesses
        made = 0  # guesses of each row still guessing
        while True:
            picked = self._pick(logits, [requests[i] for i in alive], [guesses[i] for i in alive])
            made += 1
            for i, (token, q) in zip(alive, picked, strict=True):
                guesses[i].append(token)
                if q is not None:
                    self._probs[i].append(q)
            alive = [i for i in alive if made < budgets[i]]
            if not alive:
                return guesses
            for i in alive:  # the guess is fed: its K/V hold if the target agrees
                self._feed(requests[i], guesses[i][-1])
            tokens = to_device([guesses[i][-1] for i in alive], torch.int64, self._device)
            logits = self._step(requests, alive, made, tokens)

    @property
    def _device(self) -> torch.device:
        return self.draft.runner.device

    def _catch_up(self, rows: Sequence[RequestState], index: Sequence[int]) -> torch.Tensor:
        """Compute the tokens of ``rows`` (the runner's decoding rows ``index``) that the
        draft has not computed; logits [len(rows), vocab] of each row's last token.

        A row missing at most :data:`CATCH_UP_ROWS` tokens (the usual case: the target's
        token after the accepted guesses, and the last accepted guess when all were)
        takes one decode row per token, row j at its position with the row's block
        table, so that the draft's decode CUDA graphs run them; a longer run (a new
        request's prompt, tokens of steps without speculation) goes through one varlen
        forward.
        """
        done = [r.proposer_state.valid(r.token_ids) if isinstance(r.proposer_state, DraftState)
                else 0 for r in rows]
        short: list[int] = []
        long: list[int] = []
        for n, (r, d) in enumerate(zip(rows, done, strict=True)):
            (short if len(r.token_ids) - d <= CATCH_UP_ROWS else long).append(n)
        parts: list[tuple[list[int], torch.Tensor]] = []
        if short:
            table = self.draft.runner.requests.rows
            assert table is not None
            missing = [range(done[n], len(rows[n].token_ids)) for n in short]
            positions = [p for run in missing for p in run]
            expanded = DecodeRows(
                tokens=to_device([rows[n].token_ids[p] for n, run in zip(short, missing,
                                                                          strict=True)
                                  for p in run], torch.int64, self._device),
                seq_lens=to_device(positions, torch.int32, self._device),
                block_tables=table.block_tables.index_select(0, to_device(
                    [index[n] for n, run in zip(short, missing, strict=True) for _ in run],
                    torch.int64, self._device)),
            )
            last = to_device([e - 1 for e in itertools.accumulate(map(len, missing))],
                             torch.int64, self._device)
            logits = self.draft.decode_logits(expanded, max(positions) + 1)
            parts.append((short, logits.index_select(0, last)))
        if long:
            chunks = [SeqChunk(rows[n].token_ids[done[n]:], done[n], rows[n].block_table)
                      for n in long]
            parts.append((long, self.draft.chunk_logits(chunks)))
        if len(parts) == 1:
            return parts[0][1]
        order = to_device([n for members, _ in parts for n in members], torch.int64,
                          self._device)
        stacked = torch.cat([logits.float() for _, logits in parts])
        return torch.empty_like(stacked).index_copy_(0, order, stacked)

    def _step(self, requests: Sequence[RequestState], alive: Sequence[int], made: int,
              tokens: torch.Tensor) -> torch.Tensor:
        """One draft decode step of the rows ``alive``, each of which has ``made``
        guesses, fed ``tokens`` ([len(alive)] int64 on the device): each row's latest
        guess; logits [len(alive), vocab]."""
        table = self.draft.runner.requests.rows
        assert table is not None
        seq_lens = [len(requests[i].token_ids) - 1 + made for i in alive]
        rows = DecodeRows(
            tokens=tokens,
            seq_lens=to_device(seq_lens, torch.int32, self._device),
            block_tables=table.block_tables.index_select(
                0, to_device(alive, torch.int64, self._device)),
        )
        return self.draft.decode_logits(rows, max(seq_lens) + 1)

    @staticmethod
    def _feed(request: RequestState, guess: int) -> None:
        state = request.proposer_state
        assert isinstance(state, DraftState)
        state.fed = (*state.fed, guess)

    def _greedy(self, logits: torch.Tensor, requests: Sequence[RequestState],
                budgets: Sequence[int], alive: list[int], guesses: list[list[int]]) -> None:
        """Plain greedy rows: each guess the argmax, kept on the device and fed to the
        next step without a copy to the host, so that the k steps launch back to back;
        the guesses reach the host once, at the end."""
        picked: list[tuple[list[int], torch.Tensor]] = []
        made = 0  # guesses of each row still guessing
        while True:
            tokens = logits[:, : self.draft.vocab_size].argmax(dim=-1)
            picked.append((alive, tokens))
            made += 1
            kept = [n for n, i in enumerate(alive) if made < budgets[i]]
            if not kept:
                break
            if len(kept) < len(alive):
                tokens = tokens.index_select(0, to_device(kept, torch.int64, self._device))
                alive = [alive[n] for n in kept]
            logits = self._step(requests, alive, made, tokens)
        values = iter(torch.cat([tokens for _, tokens in picked]).tolist())
        for members, _ in picked:
            for i in members:
                guesses[i].append(next(values))
        for i, g in enumerate(guesses):  # every guess but the last was fed
            for guess in g[:-1]:
                self._feed(requests[i], guess)

    def _pick(self, logits: torch.Tensor, requests: Sequence[RequestState],
              guesses: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor | None]]:
        """The next guess of each row from the draft's ``logits`` and, for a sampled
        row, the distribution it was drawn from."""
        logits = logits[:, : self.draft.vocab_size].float()
        if logits.shape[1] < self.draft.vocab_size:  # a draft with a narrower head
            logits = torch.nn.functional.pad(logits, (0, self.draft.vocab_size - logits.shape[1]),
                                             value=float("-inf"))
        rows = []
        for r, g in zip(requests, guesses, strict=True):
            seen: Sequence[int] = [*r.token_ids, *g] if g else r.token_ids
            params = dataclasses.replace(r.sampling, seed=r.sampling.seed ^ DRAFT_SEED_SALT)
            rows.append(SamplingRow(params, r.num_generated + len(g), seen,
                                    TokenSuffix(seen, r.num_generated + len(g))))
        tokens = sample(logits, rows).token_ids.tolist()
        sampled = [j for j, r in enumerate(requests) if r.sampling.do_sample]
        probs: list[torch.Tensor | None] = [None] * len(requests)
        if sampled:
            q = sampling_probs(logits[sampled], [rows[j] for j in sampled])
            for n, j in enumerate(sampled):
                probs[j] = q[n]
        return list(zip(tokens, probs, strict=True))
