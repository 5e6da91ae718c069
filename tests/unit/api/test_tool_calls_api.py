"""Chat tool calling through the real app and engine with scripted tokens: ``auto``
answers are parsed into ``tool_calls`` (whole and streamed), tools and tool history
reach the prompt, and forced calls or response formats send a grammar to the shards."""

from __future__ import annotations

import json

import pytest

from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, sse_data, text_script

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# the tool listing makes prompts longer than the scripted app's default budgets
BUDGETS = {"max_input_tokens": 512, "max_total_tokens": 1024, "max_batch_prefill_tokens": 1024}
ANSWER = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          "</tool_call>")


def chat_body(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, **fields}


async def test_auto_calls_are_parsed_whole_and_streamed(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, ANSWER), **BUDGETS)
    response = await client.post("/v1/chat/completions", json=chat_body(tools=[WEATHER]))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    prompt = tokenizer.decode(list(shard.prefilled[0].input_ids), skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt  # the template has no tools
    assert shard.prefilled[0].grammar == ""  # auto is not constrained

    response = await client.post("/v1/chat/completions",
                                 json=chat_body(tools=[WEATHER], stream=True))
    chunks = [json.loads(d) for d in sse_data(response.text) if d != "[DONE]"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    deltas = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "Checking." and "<tool_call>" not in content
    assert [d["function"] for d in deltas] == [call["function"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_plain_answer_with_tools_is_content(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, "It is <b>sunny</b>."), **BUDGETS)
    body = (await client.post("/v1/chat/completions", json=chat_body(tools=[WEATHER]))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] == "It is <b>sunny</b>."
    response = await client.post("/v1/chat/completions",
                                 json=chat_body(tools=[WEATHER], stream=True))
    chunks = [json.loads(d) for d in sse_data(response.text) if d != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "It is <b>sunny</b>."


async def test_forced_calls_and_response_formats_send_grammars(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, shard, _ = await make_app(
        text_script(tokenizer, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
        **BUDGETS)
    body = (await client.post("/v1/chat/completions", json=chat_body(
        tools=[WEATHER], tool_choice="required"))).json()
    grammar = json.loads(shard.prefilled[-1].grammar)
    schema = grammar["grammars"][0]["json_schema"]
    assert schema["minItems"] == 1 and schema["items"]["properties"]["name"] == {
        "const": "get_weather"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Rome"}'
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                "type": "array"}}}):
        await client.post("/v1/chat/completions", json=chat_body(response_format=response_format))
        sent = json.loads(shard.prefilled[-1].grammar)["grammars"][0]["json_schema"]
        assert sent["type"] == ("object" if response_format["type"] == "json_object" else "array")
    await client.post("/v1/chat/completions", json=chat_body(response_format={"type": "text"}))
    assert shard.prefilled[-1].grammar == ""


async def test_tool_history_reaches_the_prompt(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, "Sunny."), **BUDGETS)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    response = await client.post("/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 5})
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(list(shard.prefilled[0].input_ids), skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.mark.parametrize(("messages", "field"), [
    ([USER, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "system", "content": None}, USER], "messages[0].content"),
    ([USER, {"role": "assistant", "content": None}], "messages[1].content"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": None,
                                                         "tool_call_id": "call_1"}],
     "messages[2].content"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "21 C"}],
     "messages[2].tool_call_id"),
    ([USER, {"role": "assistant", "tool_calls": [
        CALL, {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}],
     "messages[1].tool_calls[1].function.arguments"),
])
async def test_bad_messages_are_400_naming_the_field(
    make_app: AppFactory, tokenizer: Tokenizer, messages: list[dict[str, object]], field: str
) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, "Sunny."), **BUDGETS)
    response = await client.post("/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 5})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    assert not shard.prefilled


async def test_assistant_calls_without_content_are_accepted(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, "Sunny."), **BUDGETS)
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    response = await client.post("/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 5})
    assert response.status_code == 200, response.text


def tool(name: str, parameters: dict[str, object], description: str = "") -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}


UNSATISFIABLE = {"type": "object", "required": ["n"],
                 "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize(("tools", "tool_choice", "field"), [
    ([tool("f", {"$ref": "#/$defs/Nope"})], None, "tools[0].function.parameters"),
    ([tool("f", CITY), tool("g", {"type": "object", "properties": {"a": {
        "$ref": "#/$defs/Missing"}}, "$defs": {"Other": {}}})],
     "required", "tools[1].function.parameters"),
    # compiles alone as a schema, but no call can satisfy it: the forced grammar fails
    ([tool("g", UNSATISFIABLE)], "required", "tools[0].function.parameters"),
    ([tool("f", CITY), tool("g", UNSATISFIABLE)],
     {"type": "function", "function": {"name": "g"}}, "tools[1].function.parameters"),
    # tools that make the prompt longer than max_input_tokens
    ([tool(f"f{i}", CITY, "word " * 60) for i in range(12)], None, "tools"),
])
async def test_bad_tools_are_400_naming_the_field(
    make_app: AppFactory, tokenizer: Tokenizer, tools: list[dict[str, object]],
    tool_choice: object, field: str
) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, "Sunny."), **BUDGETS)
    body = chat_body(tools=tools, **({"tool_choice": tool_choice} if tool_choice else {}))
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    assert "/items" not in error["message"]  # the user's pointers, not the forced schema's
    assert not shard.prefilled


async def test_long_messages_with_tools_still_name_messages(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, "Sunny."), **BUDGETS)
    body = chat_body(tools=[WEATHER], messages=[{"role": "user", "content": "word " * 600}])
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
