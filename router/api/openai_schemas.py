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

from router.parameters import MAX_PENALTY, MAX_SEED, MIN_PENALTY


def _is_none(value: object) -> bool:
    return value is None


def _omitted() -> Any:
    """A field of a stream chunk left out of its JSON while None (OpenAI's chunks carry
    only the delta's fields that changed), where a choice's ``finish_reason`` and
    ``logprobs`` are always present, null until set."""
    return Field(default=None, exclude_if=_is_none)

# NOTE: the one list of OpenAI request fields this server does not implement: field →
# why. Delete an entry when its feature lands. A field is only refused when set to
# something other than "off": null, an empty list or object, false, or a value of
# OFF_VALUES. (``tools`` and ``tool_choice`` are fields of chat requests only, so on
# /v1/completions they land here.)
UNSUPPORTED_FIELDS: dict[str, str] = {
    "tools": "tool calling is only supported on /v1/chat/completions",
    "tool_choice": "tool calling is only supported on /v1/chat/completions",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "insertion after a suffix is not supported",
    "web_search_options": "web search is not supported",
}
OFF_VALUES: dict[str, tuple[Any, ...]] = {
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


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must follow."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="A JSON schema; {} = any JSON."
    )
    strict: bool | None = Field(
        None, description="true: refuse schema keywords the grammar cannot enforce; "
        "false/null: ignore them. The output always follows the rest of the schema."
    )


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (default), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON following ``json_schema.schema``), enforced while decoding."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``."""

    # The members do not overlap in strict mode, so the first that validates is the one
    # smart mode would pick; token ids come before strings because smart mode tried
    # list[str] and list[list[int]] on them too, building an error per id (180 µs for
    # 1024 ids, 26 now).
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., union_mode="left_to_right", description="A prompt, a list of prompts, or token ids."
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


class FunctionCall(BaseModel):
    """A call of a function: its name and its arguments as JSON text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments; null = no arguments."
    )
    strict: bool | None = None


class Tool(BaseModel):
    """``tools[i]``: a function tool."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the answer is a call of it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    """One message of a conversation (an assistant's may carry its tool calls, a
    ``tool`` message answers the call ``tool_call_id``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

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
        None, ge=0, description="Alternatives per token (needs logprobs; at most "
        "--max-top-n-tokens)."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: no calls; auto (default with tools): the model chooses; "
        "required: one or more calls; a named function: one call of it."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (tool_choice required)."
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
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = _omitted()
    arguments: str | None = _omitted()


class ToolCallDelta(BaseModel):
    """A streamed piece of tool call ``index`` (id, type and name come first)."""

    index: int
    id: str | None = _omitted()
    type: Literal["function"] | None = _omitted()
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = _omitted()
    content: str | None = _omitted()
    tool_calls: list[ToolCallDelta] | None = _omitted()


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = _omitted()
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omitted()


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = _omitted()
    choices: list[CompletionChoice]
    usage: Usage | None = _omitted()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shardserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
