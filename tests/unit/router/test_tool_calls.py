"""Tool calls parsed out of text (Hermes, Llama 3 JSON), whole and streamed; the schema
of forced calls; the grammar checker's errors and time limit."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from router.grammar import (
    GrammarChecker,
    GrammarError,
    json_schema_grammar,
    regex_grammar,
)
from router.tokenizer import Tokenizer
from router.tool_calls import (
    ParsedCall,
    ToolCallStream,
    forced_call_schema,
    parse_forced,
    parse_tool_calls,
    template_renders_tools,
    tool_call_format,
    unresolved_ref,
)

HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_calls_and_content() -> None:
    content, calls = parse_tool_calls(HERMES_TEXT, "hermes")
    assert content == "Let me check."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")]


def test_hermes_unterminated_last_call_and_invalid_blocks() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}', "hermes")
    assert content is None and calls == [ParsedCall("f", '{"a": 1}')]
    text = "<tool_call>not json</tool_call> hi"
    assert parse_tool_calls(text, "hermes") == (text, [])
    assert parse_tool_calls("plain answer", "hermes") == ("plain answer", [])


STREAM_TEXTS = [
    HERMES_TEXT,
    "Sure, checking.\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
    "\n  Lead. \n\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n After.",
    "A <tool_call>not json</tool_call> \n",
    "text that ends in a partial tag <tool_",
    "no call here \n ",
    "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>\n",
    "x\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>\n\n"
    "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
]
OFFERED = frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_content_and_calls_equal_the_whole_answers(text: str, chunk: int) -> None:
    stream = ToolCallStream("hermes", OFFERED)
    sent = "".join(stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk))
    rest, calls = stream.finish()
    content, whole_calls = parse_tool_calls(text, "hermes", OFFERED)
    assert (sent + rest, calls) == (content or "", whole_calls)


def test_calls_of_functions_not_offered_stay_content() -> None:
    content, calls = parse_tool_calls(HERMES_TEXT, "hermes", {"get_weather"})
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}')]
    assert content is not None and '"get_time"' in content
    llama = '{"name": "get_time", "parameters": {}}'
    assert parse_tool_calls(llama, "llama3_json", {"get_weather"}) == (llama, [])
    assert parse_tool_calls(llama, "llama3_json", {"get_time"})[1] == [ParsedCall("get_time", "{}")]


def test_llama3_json_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse_tool_calls(text, "llama3_json") == (
        None, [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")])
    assert parse_tool_calls("The answer is 4.", "llama3_json") == ("The answer is 4.", [])
    assert parse_tool_calls('{"no_name": 1}', "llama3_json") == ('{"no_name": 1}', [])


def test_arguments_given_as_json_text_are_accepted() -> None:
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "hermes")
    assert calls == [ParsedCall("f", '{"a": 2}')]


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_stream_holds_back_calls_and_sends_content(cut: int) -> None:
    stream = ToolCallStream("hermes")
    pieces = [HERMES_TEXT[i : i + cut] for i in range(0, len(HERMES_TEXT), cut)]
    sent = "".join(stream.feed(piece) for piece in pieces)
    tail, calls = stream.finish()
    assert "<" not in sent and (sent + tail).strip() == "Let me check."
    assert calls == parse_tool_calls(HERMES_TEXT, "hermes")[1]


def test_stream_releases_a_false_alarm() -> None:
    stream = ToolCallStream("hermes")
    sent = stream.feed("a <to") + stream.feed("ken> b")
    tail, calls = stream.finish()
    assert sent + tail == "a <token> b" and calls == []


def test_llama3_stream() -> None:
    stream = ToolCallStream("llama3_json")
    assert stream.feed(" ") + stream.feed('{"name": "f", ') + stream.feed('"parameters": {}}') == ""
    assert stream.finish() == ("", [ParsedCall("f", "{}")])
    stream = ToolCallStream("llama3_json")
    assert stream.feed("Hello") + stream.feed(" there") == "Hello there"


def test_format_detection() -> None:
    assert tool_call_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_call_format("<|python_tag|>{{ x }}") == "llama3_json"
    assert tool_call_format(None) == "hermes"
    assert template_renders_tools("{% for t in tools %}{% endfor %}")
    assert not template_renders_tools("{{ messages }}")


FUNCTIONS = [
    {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                 "required": ["x"]}},
    {"name": "b"},
]


def test_forced_call_schema() -> None:
    named = forced_call_schema(FUNCTIONS, "a", True)
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "b", "arguments": {}}, named)
    required = forced_call_schema(FUNCTIONS, None, False)
    jsonschema.validate([{"name": "b", "arguments": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "arguments": {}}] * 2, required)
    assert "maxItems" not in forced_call_schema(FUNCTIONS, None, True)
    assert parse_forced('[{"name": "a", "arguments": {"x": 1}}]') == [ParsedCall("a", '{"x": 1}')]
    assert parse_forced('{"name": "a", "arguments": {"x"') is None


@pytest.fixture(scope="module")
def checker(default_model_dir: Path) -> GrammarChecker:
    return GrammarChecker(Tokenizer.from_folder(default_model_dir))


# Parameter schemas as pydantic writes them for nested models: local references into
# their own $defs / definitions, and a recursive one to the root ("#").
NESTED_FUNCTIONS = [
    {"name": "where", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {
            "city": {"type": "string"}, "near": {"$ref": "#/$defs/Loc"},
            "tag": {"const": {"$ref": "#/not/a/schema"}}}, "required": ["city"]}}}},
    {"name": "tree", "parameters": {
        "type": "object", "properties": {"size": {"$ref": "#/definitions/Size"},
                                         "child": {"$ref": "#"}},
        "definitions": {"Size": {"type": "integer", "minimum": 0}}}},
]


@pytest.mark.parametrize("named,parallel", [("where", True), ("tree", True), (None, True),
                                            (None, False)])
def test_forced_call_schema_keeps_local_references(
    named: str | None, parallel: bool, checker: GrammarChecker
) -> None:
    functions = [f for f in NESTED_FUNCTIONS if named in (None, f["name"])]
    if named is None and not parallel:
        functions = functions[:1]  # one function: its call schema is the array's items
    schema = forced_call_schema(functions, named, parallel)
    where = {"name": "where", "arguments": {"loc": {"city": "a", "near": {"city": "b"}}}}
    tree = {"name": "tree", "arguments": {"size": 1, "child": {"size": 2, "child": {}}}}
    good = {"where": where, "tree": tree}
    bad = {"where": {"name": "where", "arguments": {"loc": {"near": {"city": "b"}}}},
           "tree": {"name": "tree", "arguments": {"child": {"size": -1}}}}
    for function in functions:
        name = function["name"]
        document = good[name] if named else [good[name]]
        jsonschema.validate(document, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad[name] if named else [bad[name]], schema)
    # A "$ref" inside data (the const) is kept; the grammar compiles against the tokenizer.
    if functions[0]["name"] == "where":
        assert json.dumps({"$ref": "#/not/a/schema"}) in json.dumps(schema)
    checker.check(json_schema_grammar(schema, strict=False))


def test_checker_errors_name_the_problem(checker: GrammarChecker) -> None:
    with pytest.raises(GrammarError, match="unclosed group"):
        checker.check(regex_grammar("(ab"))
    with pytest.raises(GrammarError, match="not a valid JSON schema"):
        json_schema_grammar({"type": "object", "required": "a"})
    with pytest.raises(GrammarError, match="format"):
        checker.check(json_schema_grammar({"type": "string", "format": "bogus"}, strict=True))
    checker.check(json_schema_grammar({"type": "string", "format": "bogus"}, strict=False))
    checker.check(json_schema_grammar(json.dumps({"enum": [1, 2]})))


def test_checker_time_limit(default_model_dir: Path) -> None:
    slow = GrammarChecker(Tokenizer.from_folder(default_model_dir), timeout_s=1e-4)
    slow.lltokenizer  # noqa: B018 - built outside the limit
    big = json_schema_grammar({"enum": [f"value {i} " * 4 for i in range(20000)]})
    with pytest.raises(GrammarError, match="did not compile within"):
        slow.check(big)


def test_unresolved_local_refs() -> None:
    defs = {"$defs": {"a/b": {"type": "string"}, "L": {"items": [{"type": "integer"}]}}}
    resolving = [{"$ref": "#"}, {"$ref": "#/$defs/a~1b"}, {"$ref": "#/%24defs/L/items/0"},
                 {"$ref": "#anchor"}, {"$ref": "other.json#/x"}, {"const": {"$ref": "#/x"}},
                 {"properties": {"p": {"$id": "sub", "$ref": "#/x"}}}]
    for schema in resolving:
        assert unresolved_ref({**defs, **schema}) is None, schema
    assert unresolved_ref({**defs, "properties": {"p": {"$ref": "#/$defs/L/items/1"}}}) == (
        "`$ref` `#/$defs/L/items/1` (at /properties/p) points to nothing in the schema")
    assert unresolved_ref({"anyOf": [{}, {"$ref": "#/$defs/x"}]}) is not None
