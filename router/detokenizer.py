"""Incremental detokenization: the text each new token adds, without broken characters.

Decoding tokens one at a time loses leading spaces (SentencePiece / byte-level BPE mark
them relative to the previous token) and splits multi-byte characters across tokens.
The method (also used by vLLM and TGI) decodes a short window of recent tokens twice,
the text up to the previous token and up to the new token, and emits the difference;
while the newest decode ends with U+FFFD (an incomplete UTF-8 sequence) nothing is
emitted and the tokens wait. The Hugging Face ``tokenizers`` library implements it in
Rust as ``tokenizers.decoders.DecodeStream`` (one call per token, about 1 µs), which is
what runs here.

A prompt may end inside a character (token ids sent as the prompt, cut after the first
bytes of an emoji). The generated text is then vLLM's: the decode of prompt + generated
tokens minus the decode of the prompt, counted in characters; the character the prompt
began belongs to the prompt (its U+FFFD becomes that character), and the generated text
starts after it. Until that character is complete nothing is emitted.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from router.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens given as context, so that the first output token keeps its space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        tokenizer: The model's tokenizer.
        prompt_ids: Prompt tokens; the last few give context for the first output token.
        skip_special_tokens: Drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        context = prompt_ids[-_CONTEXT_TOKENS:]
        self._emitted = context  # the last tokens whose text was emitted
        self._held: list[int] = []  # tokens after them, text not emitted yet
        # None while the prompt's last character is incomplete: DecodeStream would send
        # the prompt's text with the first delta (its prefix is the prompt's decode up to
        # its last complete character), so the first deltas are decoded here.
        self._stream: DecodeStream | None = None
        self._prompt_text = tokenizer.decode(context, skip_special_tokens)
        if not self._prompt_text.endswith(_REPLACEMENT):
            self._stream = DecodeStream(context, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is partial)."""
        self._held.append(token_id)
        if self._stream is None:
            return self._after_incomplete_prompt()
        text = self._stream.step(self._backend, token_id)
        if not text:
            return ""
        self._emitted, self._held = self._held[-_CONTEXT_TOKENS:], []
        return text

    def _after_incomplete_prompt(self) -> str:
        # The prompt ends inside a character: the text is the decode of the prompt's tail
        # and the tokens held, minus the prompt's own decode (its U+FFFD included), once
        # it ends with a complete character; then the DecodeStream takes over from there.
        tokens = self._emitted + self._held
        full = self._tokenizer.decode(tokens, self._skip_special_tokens)
        if full.endswith(_REPLACEMENT) or len(full) <= len(self._prompt_text):
            return ""
        self._emitted, self._held = tokens[-_CONTEXT_TOKENS:], []
        self._stream = DecodeStream(self._emitted, self._skip_special_tokens)
        return full[len(self._prompt_text):]

    def flush(self) -> str:
        """Text still held at the end of generation (a character left incomplete by the
        token limit is dropped rather than sent as U+FFFD, the text before it is kept)."""
        if not self._held:
            return ""
        held, self._held = self._held, []
        return text_after(self._tokenizer, self._emitted, held, self._skip_special_tokens)


def text_after(tokenizer: Tokenizer, context: list[int], token_ids: list[int],
               skip_special_tokens: bool = True) -> str:
    """The text ``token_ids`` add after ``context`` (one decode of each), without a
    trailing incomplete character; what the deltas of :class:`IncrementalDetokenizer`
    and its :meth:`~IncrementalDetokenizer.flush` add up to, at one decode's cost.

    Args:
        context: Tokens before (a prompt's last few), so that the first keeps its space.
        token_ids: The tokens whose text is wanted.
    """
    decode = tokenizer.decode
    before = decode(context, skip_special_tokens)
    full = decode(context + token_ids, skip_special_tokens).rstrip(_REPLACEMENT)
    return full[len(before):] if len(full) > len(before) else ""


def generated_text(tokenizer: Tokenizer, prompt_ids: list[int] | tuple[int, ...],
                   output_ids: list[int]) -> str:
    """The whole text of ``output_ids`` generated after ``prompt_ids``, decoded at once
    (special tokens skipped), equal to the concatenated deltas of an
    :class:`IncrementalDetokenizer` given the same prompt."""
    return text_after(tokenizer, list(prompt_ids[-_CONTEXT_TOKENS:]), output_ids)
