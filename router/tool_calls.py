"""Tool calling: tools into the prompt, the grammar of forced calls, and calls parsed
back out of the generated text (whole, or while it streams).

Formats (chosen from the model's chat template, see :func:`tool_call_format`):

- ``hermes``: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Hermes / Qwen 2.5 / many ChatML models). A template that does not render ``tools``
  itself gets them from :func:`tool_system_prompt` in this format.
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}``, calls
  separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1+ JSON tool calling).

``tool_choice`` ``required`` or a named function constrains the output with a JSON
schema built from the functions' parameter schemas (:func:`forced_call_schema`): a JSON
array of calls, or one call object; ``auto`` lets the model choose and parses its text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

ToolCallFormat = Literal["hermes", "llama3_json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(
    re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL
)


@dataclass(frozen=True)
class ParsedCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The call format of the model family whose chat template is ``chat_template``."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the chat template reads the ``tools`` variable itself."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Instructions listing ``tools`` (OpenAI ``{"type": "function", "function": ...}``
    entries) and the Hermes call format, for templates that do not render tools."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to answer the user. The functions are listed "
        f"as JSON within <tools></tools>:\n<tools>\n{listing}\n</tools>\n"
        "To call a function, answer with a JSON object giving its name and arguments "
        "within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


# Keywords whose values are schemas keyed by name (the names are not keywords).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
# Keywords whose values are data, not schemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def rebase_refs(schema: Any, pointer: str) -> Any:
    """``schema`` with its local references (``"$ref": "#..."``) made to resolve from
    ``pointer``, the JSON Pointer (RFC 6901) at which it is embedded in another
    schema: ``#/$defs/Loc`` becomes ``#<pointer>/$defs/Loc``. Other references
    (URIs, anchors of other documents) and data (``const``, ``enum``, ``default``,
    ``examples``) are left as they are."""
    if isinstance(schema, list):
        return [rebase_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: rebase_refs(sub, pointer) for name, sub in value.items()}
        else:
            rebased[key] = rebase_refs(value, pointer)
    return rebased


def _references(schema: Any, at: str = "") -> list[tuple[str, Any, str]]:
    """(keyword, value, where) of each ``$ref`` and ``$id`` of ``schema``, ``where``
    the JSON Pointer of the schema holding it; schemas are walked as :func:`rebase_refs`
    walks them (data keywords skipped)."""
    if isinstance(schema, list):
        return [ref for i, item in enumerate(schema) for ref in _references(item, f"{at}/{i}")]
    if not isinstance(schema, dict):
        return []
    found: list[tuple[str, Any, str]] = []
    for key, value in schema.items():
        if key in ("$ref", "$id"):
            found.append((key, value, at))
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found += _references(sub, f"{at}/{key}/{name}")
        elif key not in _DATA_KEYWORDS:
            found += _references(value, f"{at}/{key}")
    return found


def _resolves(document: Any, pointer: str) -> bool:
    """Whether the JSON Pointer ``pointer`` (RFC 6901, URI-encoded as in a fragment)
    names a value of ``document``."""
    node = document
    for token in unquote(pointer).split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


def unresolved_ref(schema: Any) -> str | None:
    """Why a local ``$ref`` of ``schema`` (``#/$defs/Loc``) points to nothing in it (the
    first such), or None. References by anchor (``#name``) or to other documents are not
    checked, nor any in a schema that sets ``$id`` below its root (a new base for the
    references within)."""
    found = _references(schema)
    if any(key == "$id" and where for key, _, where in found):
        return None
    for key, ref, where in found:
        if (key == "$ref" and isinstance(ref, str) and ref.startswith("#/")
                and not _resolves(schema, ref[1:])):
            return f"`$ref` `{ref}` (at {where or '/'}) points to nothing in the schema"
    return None


def _call_schema(function: dict[str, Any], pointer: str) -> dict[str, Any]:
    """The schema of one call object of ``function``, embedded at ``pointer``: its
    parameter schema's local references (``#/$defs/...``, ``#``) are rebased onto
    ``pointer/properties/arguments``, where that schema now lies."""
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]},
                       "arguments": rebase_refs(parameters, pointer + "/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(
    functions: list[dict[str, Any]], named: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON schema of a forced answer.

    Args:
        functions: the ``function`` objects of the tools (name, parameters).
        named: the function ``tool_choice`` names (one call object of it), or None for
            ``required`` (an array of one or more calls of any function).
        parallel: ``parallel_tool_calls``: more than one call allowed (``required``).
    """
    if named is not None:
        return _call_schema(next(f for f in functions if f["name"] == named), "")
    single = len(functions) == 1  # then the call schema is the items schema itself
    items = [_call_schema(f, "/items" if single else f"/items/anyOf/{i}")
             for i, f in enumerate(functions)]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_from_object(value: Any) -> ParsedCall | None:
    """A call from ``{"name": ..., "arguments" | "parameters": {...}}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_forced(text: str) -> list[ParsedCall] | None:
    """Calls of an answer constrained by :func:`forced_call_schema` (an object or an
    array of them); None when the text is not complete JSON (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [_call_from_object(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _offered_call(block: str, names: Collection[str] | None) -> ParsedCall | None:
    """The call written in ``block`` (JSON text), if it is one of a function in
    ``names`` (any name when None)."""
    try:
        call = _call_from_object(json.loads(block))
    except json.JSONDecodeError:
        return None
    if call is None or (names is not None and call.name not in names):
        return None
    return call


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, names: Collection[str] | None = None
) -> tuple[str | None, list[ParsedCall]]:
    """Split free text (``tool_choice`` ``auto``) into content and calls.

    Args:
        names: the functions offered; a call of another name is no call (OpenAI never
            answers with a function it was not given). None: any name.

    Returns:
        (content, calls): the text outside the calls (None when empty) and the calls in
        order; a block that is not a valid call stays in the content. With calls, the
        content is the text before the first call without its trailing whitespace,
        then the text between and after the calls that is not whitespace alone (the
        same whether streamed or not: see :class:`ToolCallStream`); without, the text
        as it is.
    """
    if fmt == "llama3_json":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if body.startswith("{"):
            calls = []
            for part in body.split(";"):
                call = _offered_call(part, names)
                if call is None:
                    return text or None, []
                calls.append(call)
            return None, calls
        return text or None, []
    calls = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        call = _offered_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        calls.append(call)
        last = match.end()
    kept.append(text[last:])
    if not calls:
        return text or None, []
    content = kept[0].rstrip() + "".join(part for part in kept[1:] if part.strip())
    return content or None, calls


class ToolCallStream:
    """Separates streamed text (``tool_choice`` ``auto``) into content to send now and
    text held back because it is, or may become, a tool call.

    Feed each token's text to :meth:`feed`, which returns the content safe to send;
    :meth:`finish` parses what was held back at the end.
    """

    def __init__(self, fmt: ToolCallFormat, names: Collection[str] | None = None) -> None:
        self.fmt = fmt
        self.names = names
        self._held = ""
        self._before_calls = ""  # whitespace between the content and the first call
        self._in_calls = False
        self._seen_text = False

    def feed(self, text: str) -> str:
        """Content of ``text`` that can be sent now ('' while it is held back)."""
        if self._in_calls:
            self._held += text
            return ""
        held = self._held + text
        if self.fmt == "llama3_json":
            if not self._seen_text:
                stripped = held.lstrip()
                if not stripped or PYTHON_TAG.startswith(stripped):  # undecided yet
                    self._held = held
                    return ""
                self._seen_text = True
                if stripped.startswith(("{", PYTHON_TAG)):
                    self._in_calls = True
                    self._held = held
                    return ""
            self._held = ""
            return held
        start = held.find(HERMES_OPEN)
        if start >= 0:
            self._in_calls = True
            self._held = held[start:]
            before = held[:start]
            sent = before.rstrip()
            self._before_calls = before[len(sent):]
            return sent
        # hold a tail that may be the beginning of the opening tag, and the whitespace
        # before it (dropped if a call follows)
        keep = next((n for n in range(min(len(HERMES_OPEN) - 1, len(held)), 0, -1)
                     if HERMES_OPEN.startswith(held[-n:])), 0)
        sent = held[:len(held) - keep].rstrip()
        self._held = held[len(sent):]
        return sent

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content still to send, calls) once generation has ended."""
        content, calls = parse_tool_calls(self._held, self.fmt, self.names)
        if not calls:  # no call after all: everything held is content
            content = self._before_calls + self._held
        self._held = self._before_calls = ""
        return content or "", calls
