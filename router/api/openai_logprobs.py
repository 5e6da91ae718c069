"""Logprobs of the OpenAI routes: chat ``logprobs.content`` and the legacy completions
lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

With ``echo`` and ``logprobs`` a completion's lists start with the prompt's tokens (as
OpenAI's legacy API did): the first has no logprob (nothing precedes it), the others
carry the logprob the model gave them; ``text_offset`` counts characters of the choice's
text, echoed prompt included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.api.openai_schemas import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from router.api.tgi import token_text
from router.detokenizer import IncrementalDetokenizer
from router.request import TokenEvent
from router.tokenizer import Tokenizer


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as ``echo`` shows it.

    Attributes:
        text: The echoed text: the prompt string, or the decoded prompt token ids.
        offsets: Where each prompt token starts in ``text``, characters, one per token
            that reached the model (the last ones when ``truncate`` dropped some).
    """

    text: str
    offsets: tuple[int, ...]


def echoed_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int],
                  num_tokens: int) -> EchoedPrompt:
    """The echo of ``prompt``, of which the model read the last ``num_tokens`` tokens.

    A string's offsets come from the tokenizer (as the validator encoded it, special
    tokens included); token ids are detokenized incrementally, so the offsets are those
    of the decoded text.
    """
    if isinstance(prompt, str):
        starts = [start for start, _ in tokenizer.backend.encode(prompt).offsets]
        return EchoedPrompt(prompt, tuple(starts[len(starts) - num_tokens:]))
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    text, starts = "", []
    for token_id in prompt:
        starts.append(len(text))
        text += detokenizer.add(token_id)
    text += detokenizer.flush()
    return EchoedPrompt(text, tuple(starts[len(starts) - num_tokens:]))


def completion_logprobs(
    tokenizer: Tokenizer, events: Sequence[TokenEvent], start: int,
    prompt: tuple[EchoedPrompt, Sequence[int], Sequence[float]] | None = None,
) -> CompletionLogprobs:
    """Legacy completions logprobs of ``events`` (generated tokens), the first of which
    starts at character ``start`` of the choice's text; ``prompt`` = (echo, prompt token
    ids, their logprobs from the second on) puts the prompt's tokens first. Each
    generated token's ``top_logprobs`` holds its alternatives and, as OpenAI's, the
    sampled token itself (so up to ``logprobs + 1`` entries)."""
    result = CompletionLogprobs()
    if prompt is not None:
        echo, ids, logprobs = prompt
        for i, (token_id, offset) in enumerate(zip(ids, echo.offsets, strict=True)):
            text = token_text(tokenizer, token_id)
            logprob = logprobs[i - 1] if 0 < i <= len(logprobs) else None
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(None if logprob is None else {text: logprob})
            result.text_offset.append(offset)
    offset = start
    for event in events:
        text = token_text(tokenizer, event.id)
        result.tokens.append(text)
        result.token_logprobs.append(event.logprob)
        tops = {token_text(tokenizer, top.token_id): top.logprob for top in event.top_tokens}
        # OpenAI: the sampled token's logprob is always given (up to logprobs + 1 entries)
        tops.setdefault(text, event.logprob)
        result.top_logprobs.append(tops)
        result.text_offset.append(offset)
        offset += len(event.own_text)
    return result


def chat_logprobs(tokenizer: Tokenizer, events: Sequence[TokenEvent]) -> ChoiceLogprobs:
    """Chat ``logprobs.content`` of ``events``: each token with its bytes and its
    ``top_logprobs`` alternatives."""
    content = []
    for event in events:
        text = token_text(tokenizer, event.id)
        tops = [
            TopLogprob(token=(t := token_text(tokenizer, top.token_id)), logprob=top.logprob,
                       bytes=list(t.encode()))
            for top in event.top_tokens
        ]
        content.append(TokenLogprob(token=text, logprob=event.logprob, bytes=list(text.encode()),
                                    top_logprobs=tops))
    return ChoiceLogprobs(content=content)
