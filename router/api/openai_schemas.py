"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Source: the OpenAI API reference for ``/v1/completions`` (legacy) and
``/v1/chat/completions``. Extensions beyond OpenAI (``top_k``, ``min_p``, ``typical_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``truncate``) mean what they
mean on /generate. ``temperature`` 0 is greedy; the default 1.0 samples (OpenAI's
defaults). JSON types are strict (``"5"`` is not a number, ``true`` not an integer).

Fields of :data:`UNSUPPORTED_FIELDS` are refused with a 400 naming them, so a client
never gets an answer that silently ignored what it asked for; other unknown fields are
ignored, as OpenAI clients add new ones often.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.api.schemas import MAX_PENALTY, MAX_SEED, MIN_PENALTY

# NOTE: the one list of OpenAI request fields this server does not implement: field →
# why. Delete an entry when its feature lands (structured output will retire
# response_format). A field is only refused when set to something other than "off":
# null, an empty list or object, false, or a value of OFF_VALUES.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "response_format": "structured output (JSON mode, JSON schema) is not supported yet",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "insertion after a suffix is not supported",
    "web_search_options": "web search is not supported",
}
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "modalities": (["text"],),
}


def unsupported_field(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``body`` that asks for an unsupported feature, and why."""
    for name, reason in UNSUPPORTED_FIELDS.items():
        value = body.get(name)
        if value in (None, False, [], {}) or value in OFF_VALUES.get(name, ()):
            continue
        return name, reason
    return None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are kept in
    ``model_extra`` (checked against :data:`UNSUPPORTED_FIELDS`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    model: str | None = Field(
        None, description="One of the served names (--served-model-name); another is a 404. "
        "Omitted: the first."
    )
    n: int = Field(1, ge=1, description="Choices to generate (<= --max-best-of).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description="Up to --max-stop-sequences stop strings; not part of the text."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Choice i uses seed + i.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="0 = greedy; default 1.0 (sampling)."
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus mass; 1.0 = off.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    # Extensions (vLLM / TGI names).
    top_k: int | None = Field(None, ge=-1, description="null, 0 or -1 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_PENALTY, le=MAX_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    truncate: int | None = Field(None, ge=1, description="Keep the last N prompt tokens.")


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A prompt, a list of prompts, or token ids."
    )
    max_tokens: int | None = Field(16, ge=1, description="Tokens to generate (default 16).")
    logprobs: int | None = Field(
        None, ge=0, description="Return the logprobs of this many alternatives per token."
    )
    echo: bool = Field(False, description="Prepend the prompt to each choice's text.")
    best_of: int | None = Field(None, ge=1, description="Sample best_of, return the n best.")


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated name of the next.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return logprobs of the chosen tokens.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Alternatives per token (needs logprobs)."
    )


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    """Token counts of a request (all choices together)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token (with ``echo``
    the prompt's tokens first: the first has no logprob, the others list only
    themselves in ``top_logprobs``). ``text_offset``: where each token starts in the
    choice's text, in characters."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shardserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
