"""Structured output and tool calling of the OpenAI routes: ``response_format``,
``tools`` / ``tool_choice`` into a grammar and a prompt, and tool calls out of the text.

Source: the OpenAI API reference (chat completions: ``response_format``, ``tools``,
``tool_choice``, ``parallel_tool_calls``; streamed ``delta.tool_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from router.api.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    ResponseFormat,
    ToolCall,
    ToolCallDelta,
)
from router.grammar import GrammarError, check_json_schema
from router.parameters import GrammarParameters
from router.tokenizer import Tokenizer
from router.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ParsedCall,
    ToolCallFormat,
    ToolCallStream,
    forced_call_schema,
    new_call_id,
    parse_forced,
    parse_tool_calls,
    template_renders_tools,
    tool_call_format,
    tool_system_prompt,
    unresolved_ref,
)
from router.validation import RequestValidationError, Validator

ToolMode = Literal["none", "auto", "forced"]
RESPONSE_SCHEMA_FIELD = "response_format.json_schema.schema"


def response_grammar(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """``parameters.grammar`` of a ``response_format`` (None for text).

    Raises:
        RequestValidationError: ``json_schema`` without its ``json_schema`` object.
    """
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json", "value": {"type": "object"}, "strict": False}
    spec = response_format.json_schema
    if spec is None:
        raise RequestValidationError(
            "response_format.json_schema", "is required when type is json_schema"
        )
    return {"type": "json", "value": spec.schema_ or {}, "strict": bool(spec.strict)}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its answer.

    Attributes:
        mode: ``none`` (no tools or tool_choice none), ``auto`` (the text is parsed for
            calls) or ``forced`` (required or a named function: the output is the JSON
            of the calls, constrained by ``grammar``).
        tools: the tools as template objects (None when mode is none).
        grammar: ``parameters.grammar`` of a forced answer.
        fmt: the model family's call format.
        named: the function tool_choice names, if any.
    """

    mode: ToolMode
    tools: list[dict[str, Any]] | None
    grammar: dict[str, Any] | None
    fmt: ToolCallFormat
    named: str | None = None

    @property
    def names(self) -> frozenset[str]:
        """The names of the functions offered."""
        return frozenset(tool["function"]["name"] for tool in self.tools or ()
                         if tool.get("type", "function") == "function")


def tool_plan(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolPlan:
    """Check ``tools``, ``tool_choice`` and ``response_format`` together.

    Raises:
        RequestValidationError: a tool's parameters are not a JSON schema (or refer
            to a part of it that does not exist), two tools share a name, tool_choice
            names an unknown function or needs tools that are not given, or
            response_format is combined with a forced call.
    """
    fmt = tool_call_format(tokenizer.chat_template)
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else (
        "auto" if tools else "none"
    )
    names = [tool.function.name for tool in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise RequestValidationError(
                f"tools[{i}].function.name", f"`{tool.function.name}` is defined twice"
            )
        if tool.function.parameters is not None:
            try:
                check_json_schema(tool.function.parameters)
            except GrammarError as error:
                raise RequestValidationError(
                    f"tools[{i}].function.parameters", str(error)
                ) from None
            unresolved = unresolved_ref(tool.function.parameters)
            if unresolved is not None:
                raise RequestValidationError(f"tools[{i}].function.parameters", unresolved)
    named = None if isinstance(choice, str) else choice.function.name
    if named is not None and named not in names:
        raise RequestValidationError(
            "tool_choice.function.name",
            f"`{named}` is not among the tools ({', '.join(names) or 'none given'})",
        )
    if choice == "required" and not tools:
        raise RequestValidationError("tool_choice", "`required` needs at least one tool")
    if choice == "none" or not tools:
        return ToolPlan("none", None, None, fmt)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "auto":
        return ToolPlan("auto", template_tools, None, fmt)
    if body.response_format is not None and body.response_format.type != "text":
        raise RequestValidationError(
            "response_format", "cannot be combined with tool_choice `required` or a named "
            "function (the answer is then the calls' JSON)"
        )
    functions = [tool.function.model_dump(exclude_none=True) for tool in tools]
    parallel = body.parallel_tool_calls is not False
    schema = forced_call_schema(functions, named, parallel)
    # lenient: the user's parameter schemas were checked above; keywords the grammar
    # cannot enforce are ignored rather than refused, as OpenAI's non-strict tools
    grammar = {"type": "json", "value": schema, "strict": False}
    return ToolPlan("forced", template_tools, grammar, fmt, named)


def blame_tool(error: RequestValidationError, plan: ToolPlan,
               body: ChatCompletionRequest, validator: Validator) -> RequestValidationError:
    """The error of a forced answer's grammar (``grammar.value``), named after the tool
    whose parameters cause it: each offered function's parameters (only the named one's
    for a named tool_choice) are compiled alone, and the first that fails is named,
    ``tools[i].function.parameters``, with its own message; when none fails alone, the
    error names ``tools``. Blocking (compiles; call off the event loop)."""
    for i, tool in enumerate(body.tools or ()):
        parameters = tool.function.parameters
        if parameters is None or plan.named not in (None, tool.function.name):
            continue
        try:
            validator.grammar(GrammarParameters(type="json", value=parameters, strict=False))
        except RequestValidationError as own:
            return RequestValidationError(f"tools[{i}].function.parameters", own.message)
    return RequestValidationError("tools", error.message)


def check_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rules for the messages of a conversation.

    Raises:
        RequestValidationError: naming the field (``messages[i].content``,
            ``messages[i].tool_call_id``, ``messages[i].tool_calls[j].function.arguments``):
            a message other than an assistant's has null content, an assistant's has
            neither content nor tool calls, a ``tool`` message has no ``tool_call_id``,
            or a call's ``arguments`` are not JSON text.
    """
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            why = ("an assistant message needs content or tool_calls" if m.role == "assistant"
                   else f"a {m.role} message needs content")
            raise RequestValidationError(f"messages[{i}].content", f"must not be null ({why})")
        if m.role == "tool" and m.tool_call_id is None:
            raise RequestValidationError(
                f"messages[{i}].tool_call_id", "is required in a tool message (the id of the "
                "call it answers)")
        for j, call in enumerate(m.tool_calls or ()):
            try:
                json.loads(call.function.arguments)
            except json.JSONDecodeError as error:
                raise RequestValidationError(
                    f"messages[{i}].tool_calls[{j}].function.arguments",
                    f"is not valid JSON ({error.msg} at character {error.pos})") from None


def chat_messages(
    messages: list[ChatMessage], plan: ToolPlan, tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template.

    A template that renders tools itself gets the messages with ``tool_calls`` /
    ``tool_call_id`` as transformers passes them, and ``tools``. Another gets the tools
    in a system message (:func:`~router.tool_calls.tool_system_prompt`), assistant
    calls written in the Hermes format and tool results inside ``<tool_response>``.
    """
    native = template_renders_tools(tokenizer.chat_template)
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            calls: list[dict[str, Any]] = [
                # checked JSON (check_messages): templates expect an object
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls
            ]
            if native:
                item["tool_calls"] = calls
            else:
                written = "\n".join(
                    f"{HERMES_OPEN}\n" + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                        ensure_ascii=False,
                    ) + f"\n{HERMES_CLOSE}"
                    for c in calls
                )
                item["content"] = (item["content"] + "\n" + written).lstrip("\n")
        if m.role == "tool":
            if native:
                if m.tool_call_id is not None:
                    item["tool_call_id"] = m.tool_call_id
            else:
                item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
        out.append(item)
    if plan.tools is None or native:
        return out, plan.tools
    prompt = tool_system_prompt(plan.tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def tool_calls_of(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer (content unchanged when mode is none, or
    when a forced answer was cut short and does not parse)."""
    if plan.mode == "none":
        return text, []
    if plan.mode == "forced":
        parsed = parse_forced(text)
        return (text, []) if parsed is None else (None, _calls(parsed))
    content, parsed = parse_tool_calls(text, plan.fmt, plan.names)
    return content, _calls(parsed)


def _calls(parsed: list[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=p.name, arguments=p.arguments))
        for p in parsed
    ]


def call_deltas(calls: list[ToolCall]) -> list[ToolCallDelta]:
    """The streamed form of ``calls``: one delta each, with id, name and arguments."""
    return [
        ToolCallDelta(index=i, id=c.id, type="function",
                      function=FunctionCallDelta(name=c.function.name,
                                                 arguments=c.function.arguments))
        for i, c in enumerate(calls)
    ]


class StreamedChoice:
    """The tool-call side of one streamed choice: which text to send as content now,
    and the calls found once it ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._stream = ToolCallStream(plan.fmt, plan.names) if plan.mode == "auto" else None
        self._forced: list[str] = []

    def feed(self, text: str) -> str:
        """Content to send for this token's ``text``."""
        if self.plan.mode == "none":
            return text
        if self._stream is None:
            self._forced.append(text)
            return ""
        return self._stream.feed(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, calls) at the end of the choice."""
        if self.plan.mode == "none":
            return "", []
        if self._stream is None:
            text = "".join(self._forced)
            parsed = parse_forced(text)
            return (text, []) if parsed is None else ("", _calls(parsed))
        content, parsed = self._stream.finish()
        return content, _calls(parsed)
