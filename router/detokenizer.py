"""Incremental detokenization: the text each new token adds, without broken characters.

Decoding tokens one at a time loses leading spaces (SentencePiece / byte-level BPE mark
them relative to the previous token) and splits multi-byte characters across tokens.
The method (also used by vLLM and TGI) decodes a short window of recent tokens twice:
the text up to the previous token (``prefix_offset:read_offset``) and up to the new token
(``prefix_offset:``); the new text is the difference. While the newest decode ends with
U+FFFD (an incomplete UTF-8 sequence) nothing is emitted and the tokens wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Attributes:
        tokenizer: The model's tokenizer.
        prompt_ids: Prompt tokens; the last few give context for the first output token.
        skip_special_tokens: Drop special tokens (EOS, chat markers) from the text.
    """

    tokenizer: Tokenizer
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    _ids: list[int] = field(default_factory=list, init=False)
    _prefix_offset: int = field(default=0, init=False)
    _read_offset: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # A few prompt tokens of context so the first output token keeps its space.
        context = self.prompt_ids[-5:]
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is partial)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        new_text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held at the end of generation. A character left incomplete by the
        token limit is dropped rather than sent as U+FFFD."""
        decode = self.tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        full = full.rstrip(_REPLACEMENT)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
