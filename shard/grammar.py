"""Grammar-constrained decoding on the shard: one matcher per constrained request.

A constrained request carries an llguidance grammar (JSON text, built and validated by
the router from a JSON schema or a regex). Each rank keeps, per request, an
``llguidance.LLMatcher`` that follows the tokens generated so far; before a token is
sampled the matcher writes a bitmask of the tokens the grammar allows next (one bit per
vocabulary entry), the bitmask goes to the device and the disallowed logits become
-inf. The sampled token then advances the matcher. Every rank samples the same token
from the same masked logits, so every rank's matcher stays in the same state.

Source of the algorithm: llguidance (Moskal et al., github.com/guidance-ai/llguidance):
an Earley parser over a derivative-based lexer, walking the token trie to compute the
mask (tens of microseconds per token); nothing is compiled ahead of time beyond the
lexer, so building a matcher costs well under a millisecond for ordinary schemas.

Costs: only constrained rows compute a mask (on the host, all rows in parallel in
llguidance's thread pool, with the GIL released); unconstrained rows of the same batch
build nothing and are never touched by the mask.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from loguru import logger
from tokenizers import Tokenizer

from shard import tokenizer_files
from shard.host_copy import to_device
from shard.records import NewRequest
from shard.sampling import TokenMask

# Compiled grammars kept per shard, by grammar text (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def eos_token_ids(model_path: str | Path) -> list[int]:
    """Every token id that ends generation, as the router counts them (see
    :func:`shard.tokenizer_files.eos_token_ids`), sorted."""
    folder = Path(model_path)
    tokenizer_file = folder / "tokenizer.json"
    token_to_id = (Tokenizer.from_file(str(tokenizer_file)).token_to_id
                   if tokenizer_file.exists() else (lambda _token: None))
    return sorted(tokenizer_files.eos_token_ids(folder, token_to_id))


def parser_limits() -> LLParserLimits:
    """Resource limits of every matcher (llguidance's defaults, with short error
    messages: a grammar's text is not repeated into the log)."""
    return LLParserLimits(verbose_errors=False)


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next.

    Args:
        matcher: a fresh llguidance matcher (owned by this object).
        request_id: for log lines.
    """

    def __init__(self, matcher: LLMatcher, request_id: int) -> None:
        self.matcher = matcher
        self.request_id = request_id
        self._warned = False
        self._check()

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (the sampled token). After the grammar is complete
        (or failed) nothing more is consumed: only EOS is allowed from then on."""
        if self.matcher.is_stopped():
            return
        self.matcher.consume_token(token_id)
        self._check()

    def accept_all(self, token_ids: Sequence[int]) -> None:
        """:meth:`accept` each of ``token_ids`` in order (rebuilding the state of a
        recomputed request from its generated tokens)."""
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def failure(self) -> str | None:
        """Why the grammar failed (a limit of llguidance reached, or a grammar that
        does not compile here), or None while it holds."""
        if not self.matcher.is_error():
            return None
        lines = self.matcher.get_error().strip().splitlines()
        return lines[0] if lines else "the grammar failed"

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and allows nothing more."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def _check(self) -> None:
        if self.matcher.is_error() and not self._warned:
            self._warned = True
            logger.warning(
                "request {}: grammar failed ({}); only EOS is allowed from here",
                self.request_id, self.matcher.get_error()[:200],
            )


class GrammarCompiler:
    """Builds matchers from grammar texts and fills the token masks of a batch.

    The llguidance tokenizer (the model's ``tokenizer.json`` with the logits' width as
    vocabulary size) is built on first use (about 0.3 s); each grammar text is compiled
    once into a template matcher and every request gets a copy of it.

    Args:
        model_path: the model folder (``tokenizer.json`` and the configs naming EOS).
        vocab_size: width of the logits, tokens (ids beyond the tokenizer's vocabulary
            are never allowed).
    """

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            text = (self.model_path / "tokenizer.json").read_text()
            self._tokenizer = LLTokenizer(
                text, n_vocab=self.vocab_size, eos_token=eos_token_ids(self.model_path)
            )
        return self._tokenizer

    @property
    def num_mask_words(self) -> int:
        """int32 words of one row's bitmask: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def matcher(
        self, grammar: str, request_id: int, generated: Sequence[int] = ()
    ) -> GrammarMatcher:
        """A matcher for ``grammar`` that has consumed ``generated`` (the tokens a
        recomputed request had generated before its preemption).

        A grammar that fails to compile gives a matcher in its error state, which
        allows only EOS: that request ends at once, the others are unaffected.
        """
        template = self._templates.get(grammar)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
            self._templates[grammar] = template
            if len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        state = GrammarMatcher(template.deep_copy(), request_id)
        state.accept_all(generated)
        return state

    def prefill_matcher(self, request: NewRequest) -> GrammarMatcher | None:
        """The grammar state of a new request (None when it is unconstrained): fresh, or
        after a recompute rebuilt from the tokens it had generated (the last
        ``num_generated`` of its ``input_ids``)."""
        if not request.grammar:
            return None
        generated = request.input_ids[len(request.input_ids) - request.num_generated:]
        return self.matcher(request.grammar, request.request_id, generated)

    def token_mask(
        self, matchers: Sequence[GrammarMatcher | None], device: torch.device
    ) -> TokenMask | None:
        """The allowed tokens of a batch's constrained rows (``matchers[i]`` None: row i
        is unconstrained), or None when no row is: the bitmasks are filled on the host
        (:meth:`fill_bitmask`), then copied and unpacked on ``device``
        ([constrained rows, vocab_size] bool)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = self.fill_bitmask([m for m in matchers if m is not None])
        allowed = unpack_bitmask(bitmask, self.vocab_size, device)
        return TokenMask(to_device(rows, torch.int64, device), allowed)

    def draft_mask(
        self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]],
        device: torch.device,
    ) -> tuple[TokenMask | None, list[list[int]]]:
        """The allowed tokens at every position of a speculative step, and the guesses
        kept: a constrained row's guesses are cut before the first one its grammar
        refuses (none once it is complete or failed).

        Position j of row i (its last token for j = 0, then guess j) is masked with the
        grammar state after the row's first j guesses: each matcher consumes its
        guesses one by one between the mask computations, then rolls them back
        (llguidance's ``rollback``); the tokens the step keeps are consumed when
        recorded.

        Args:
            matchers: each row's grammar state, None for an unconstrained row.
            drafts: each row's guesses.
            device: where the mask goes.

        Returns:
            The mask over the step's positions (row after row, ``len(kept[i]) + 1``
            each; None when no row is constrained), and ``kept``.
        """
        kept = [list(d) for d in drafts]
        for i, m in enumerate(matchers):
            if m is not None and kept[i]:
                usable = not m.matcher.is_stopped() and not m.matcher.is_error()
                kept[i] = kept[i][: m.matcher.validate_tokens(kept[i])] if usable else []
        starts = [0]
        for d in kept:
            starts.append(starts[-1] + len(d) + 1)
        slots = [starts[i] + j for i, m in enumerate(matchers) if m is not None
                 for j in range(len(kept[i]) + 1)]
        if not slots:
            return None, kept
        slot_row = {position: row for row, position in enumerate(slots)}
        bitmask = torch.empty((len(slots), self.num_mask_words), dtype=torch.int32,
                              pin_memory=torch.cuda.is_available())
        if self._executor is None:
            self._executor = LLExecutor()
        consumed = [0] * len(kept)
        for j in range(max(len(kept[i]) for i, m in enumerate(matchers) if m is not None) + 1):
            wave = [(i, m) for i, m in enumerate(matchers) if m is not None and len(kept[i]) >= j]
            self._executor.unsafe_compute_mask_ptr(
                [(m.matcher, slot_row[starts[i] + j]) for i, m in wave],
                bitmask.data_ptr(), self.num_mask_words * 4, len(slots),
            )
            for i, m in wave:
                if j < len(kept[i]) and not m.matcher.is_stopped():
                    m.matcher.consume_token(kept[i][j])
                    consumed[i] += 1
        for i, m in enumerate(matchers):
            if m is not None and consumed[i]:
                m.matcher.rollback(consumed[i])
        allowed = unpack_bitmask(bitmask, self.vocab_size, device)
        return TokenMask(to_device(slots, torch.int64, device), allowed), kept

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """Allowed next tokens of each matcher, as bits.

        Returns:
            [len(matchers), num_mask_words] int32 on the host (pinned when CUDA is
            available): bit ``t % 32`` of word ``t // 32`` of row i is set when token
            ``t`` is allowed for ``matchers[i]``. Computed by llguidance's thread pool
            with the GIL released.
        """
        bitmask = torch.empty(
            (len(matchers), self.num_mask_words), dtype=torch.int32,
            pin_memory=torch.cuda.is_available(),
        )
        if self._executor is None:
            self._executor = LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(), self.num_mask_words * 4, len(matchers),
        )
        return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bits to booleans, on ``device``.

    Args:
        bitmask: [n, words] int32 (see :meth:`GrammarCompiler.fill_bitmask`).
        vocab_size: tokens per row of the result.

    Returns:
        [n, vocab_size] bool, True where the token is allowed.
    """
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 reads right too
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
