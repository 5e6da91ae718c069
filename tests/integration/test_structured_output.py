"""Structured output and tool calling through the real server on the tiny random model,
with the ``openai`` package, plain HTTP (TGI) and the public gRPC API.

Random weights make the point: whatever the model prefers, the output follows the
grammar. Bad schemas, regexes, grammar types, tools and tool choices are refused by
name before anything reaches a shard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest

from router.pb import generate_pb2 as gpb
from router.pb import generate_pb2_grpc as gpb_grpc
from tests.integration.live_server import LiveServer, launch_tiny

MESSAGES = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = launch_tiny(tiny_model_dir, tmp_path_factory.mktemp("structured") / "server.log",
                       ["--served-model-name", "tiny"])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def response_schema(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_validates(client: openai.OpenAI, temperature: float) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=temperature, seed=3, n=2,
        response_format=response_schema(SCHEMA))  # type: ignore[arg-type]
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_completions_json_object(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="JSON:", max_tokens=150, seed=1,
                                    temperature=1.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    text = out.choices[0].text
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")


def test_tgi_regex_fullmatches_stream_and_not(server: LiveServer) -> None:
    regex = r"(red|green|blue)-[0-9]{3}"
    body = {"inputs": "Colour code:", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": regex}, "details": True,
        "ignore_eos": True}}  # a complete grammar ends the request all the same
    whole = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert re.fullmatch(regex, whole["generated_text"])
    assert whole["details"]["finish_reason"] == "eos_token"
    streamed = ""
    with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                streamed += "" if event["token"]["special"] else event["token"]["text"]
    assert streamed == whole["generated_text"]


def test_constrained_beside_unconstrained_leaves_them_unchanged(
    client: openai.OpenAI,
) -> None:
    import concurrent.futures

    def free() -> list[str | None]:
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24,
                                              temperature=0.0)
        sampled = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24,
                                                 temperature=1.0, seed=11)
        return [chat.choices[0].message.content, sampled.choices[0].message.content]

    alone = free()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(
            client.chat.completions.create, model="tiny", messages=MESSAGES, max_tokens=60,
            temperature=1.0, seed=i, response_format=response_schema(SCHEMA))
            for i in range(3)]
        together = pool.submit(free)
        assert together.result() == alone
        for future in constrained:
            content = future.result().choices[0].message.content or ""
            assert content.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_into_arguments(client: openai.OpenAI, choice: object) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                  max_tokens=80, temperature=0.0, tools=[WEATHER, TIME], tool_choice=choice,
                  parallel_tool_calls=False)
    chat = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls" and message.content is None
    calls = message.tool_calls
    assert calls is not None and len(calls) == 1
    function = calls[0].function  # type: ignore[union-attr]
    if isinstance(choice, dict):
        assert function.name == "get_weather"
    schema = {"get_weather": WEATHER, "get_time": TIME}[function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(function.arguments), schema)  # type: ignore[index]
    # streamed: the same calls as deltas, then finish_reason tool_calls
    stream = client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
    names, arguments, reasons = [], "", []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                if delta.function.name:
                    names.append(delta.function.name)
                arguments += delta.function.arguments or ""
            assert not c.delta.content
    assert names == [function.name] and arguments == function.arguments
    assert reasons[-1] == "tool_calls"


def test_tool_history_is_accepted(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                          temperature=0.0, tools=[WEATHER], tool_choice="none")  # type: ignore[list-item]
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.prompt_tokens > 60  # tool texts rendered


def bad(call) -> openai.BadRequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as failure:
        call()
    return failure.value


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"response_format": response_schema({"type": "objekt"})},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
])
def test_bad_structured_requests_are_400_naming_the_field(
    client: openai.OpenAI, kwargs: dict[str, object], field: str
) -> None:
    error = bad(lambda: client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body=kwargs))
    body = error.body
    assert isinstance(body, dict) and body.get("param") == field, body
    # schema internals (union branch tags) never reach the client
    assert "literal[" not in body["message"] and "NamedToolChoice" not in body["message"], body


@pytest.mark.parametrize(("grammar", "field"), [
    ({"type": "regex", "value": "(unclosed"}, "grammar.value"),
    ({"type": "json", "value": {"type": "objekt"}}, "grammar.value"),
    ({"type": "json", "value": "{not json"}, "grammar.value"),
    ({"type": "ebnf", "value": "x"}, "grammar.type"),
    # compile, but nothing satisfies them
    ({"type": "regex", "value": "[^\\x00-\\x{10FFFF}]"}, "grammar.value"),
    ({"type": "json", "value": {"$ref": "#"}}, "grammar.value"),
])
def test_tgi_bad_grammar_is_422_naming_the_field(
    server: LiveServer, grammar: dict[str, object], field: str
) -> None:
    response = httpx.post(f"{server.url}/generate", json={
        "inputs": "Hi", "parameters": {"grammar": grammar}}, timeout=30)
    assert response.status_code == 422, response.text
    assert field in response.json()["error"], response.text


# Compiles at the router, but llguidance's lexer gives up on the first token it consumes
# (too many expressions constructed): found only while generating.
FAILING_REGEX = "a{1000000}"


def test_grammar_failing_while_generating_is_an_error_not_an_answer(
    server: LiveServer, client: openai.OpenAI
) -> None:
    import concurrent.futures

    body = {"inputs": "Hi", "parameters": {
        "max_new_tokens": 8, "grammar": {"type": "regex", "value": FAILING_REGEX}}}
    free = {"inputs": "Hi", "parameters": {"max_new_tokens": 16, "ignore_eos": True,
                                           "details": True}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(httpx.post, f"{server.url}/generate", json=free, timeout=60)
        whole = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert beside.result().json()["details"]["generated_tokens"] == 16  # unaffected
    assert whole.status_code == 422, whole.text
    assert whole.json()["error"].startswith("grammar: failed"), whole.text
    with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=60) as r:
        text = r.read().decode()
        assert "grammar: failed" in text and '"generated_text"' not in text, text
    error = bad(lambda: client.completions.create(
        model="tiny", prompt="Hi", max_tokens=8, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "string", "pattern": f"^{FAILING_REGEX}$"}}}}))
    assert "grammar: failed" in str(error.body), error.body
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = gpb_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            stub.Generate(gpb.GenerateRequest(inputs="Hi", parameters=gpb.Parameters(
                max_new_tokens=8, grammar=gpb.Grammar(type="regex", value=FAILING_REGEX))),
                timeout=60)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_grpc_grammar(server: LiveServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = gpb_grpc.TextGenerationStub(channel)
        regex = "[a-d]{4}"
        out = stub.Generate(gpb.GenerateRequest(inputs="Letters:", parameters=gpb.Parameters(
            max_new_tokens=10, grammar=gpb.Grammar(type="regex", value=regex))), timeout=60)
        assert re.fullmatch(regex, out.sequence.generated_text)
        schema = json.dumps({"type": "object", "properties": {"x": {"enum": [1, 2]}},
                             "required": ["x"], "additionalProperties": False})
        out = stub.Generate(gpb.GenerateRequest(inputs="J:", parameters=gpb.Parameters(
            max_new_tokens=20, grammar=gpb.Grammar(type="json", value=schema))), timeout=60)
        assert json.loads(out.sequence.generated_text)["x"] in (1, 2)
        with pytest.raises(grpc.RpcError) as failure:
            stub.Generate(gpb.GenerateRequest(inputs="J:", parameters=gpb.Parameters(
                grammar=gpb.Grammar(type="regex", value="(x"))), timeout=60)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grammar.value" in (failure.value.details() or "")
