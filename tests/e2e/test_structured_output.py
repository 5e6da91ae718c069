"""Structured output and tool calling on the default model (session server, Ray + gRPC
shard + HTTP) with the real ``openai`` client: JSON schemas validate, regexes fully
match, forced tool calls parse into the function's arguments, streaming agrees with
non-streaming, and unconstrained requests batched with constrained ones give the text
they give alone."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "job": {"enum": ["doctor", "teacher", "engineer", "other"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 15},
                    "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "job", "address", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(ray_server: str) -> OpenAI:
    return OpenAI(base_url=f"{ray_server}/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def person_format() -> dict[str, object]:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_greedy_sampled_and_streamed(client: OpenAI, model: str) -> None:
    greedy = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=120, temperature=0,  # type: ignore[arg-type]
        response_format=person_format())  # type: ignore[arg-type]
    sampled = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=120, temperature=0.8, seed=5, n=2,  # type: ignore[arg-type]
        response_format=person_format())  # type: ignore[arg-type]
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=120, temperature=0, stream=True,  # type: ignore[arg-type]
        response_format=person_format())  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == greedy.choices[0].message.content


def test_regex_and_unconstrained_neighbours(client: OpenAI, model: str) -> None:
    prompt = "The date of the moon landing, as YYYY-MM-DD:"
    regex = r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"
    free_args = dict(model=model, prompt="The capital of France is", max_tokens=16,
                     temperature=0)
    alone = client.completions.create(**free_args).choices[0].text  # type: ignore[call-overload]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(
            client.completions.create, model=model, prompt=prompt, max_tokens=30,
            temperature=0.7, seed=i,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "d", "schema": {"type": "object", "properties": {
                    "date": {"type": "string", "pattern": f"^{regex}$"}},
                    "required": ["date"], "additionalProperties": False}}}},
        ) for i in range(3)]
        free = pool.submit(client.completions.create, **free_args)
        assert free.result().choices[0].text == alone
        for future in constrained:
            choice = future.result().choices[0]
            assert choice.finish_reason == "stop", choice
            assert re.fullmatch(regex, json.loads(choice.text)["date"])
    base = str(client.base_url).removesuffix("/v1/")
    out = httpx.post(f"{base}/generate", timeout=300, json={"inputs": prompt, "parameters": {
        "max_new_tokens": 16, "grammar": {"type": "regex", "value": regex}}}).json()
    assert re.fullmatch(regex, out["generated_text"])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                "function": {"name": "get_weather"}}])
def test_forced_tool_call(client: OpenAI, model: str, choice: object) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, messages=messages, max_tokens=80, temperature=0,
                  tools=[WEATHER], tool_choice=choice)
    chat = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert chat.choices[0].finish_reason == "tool_calls"
    calls = chat.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    streamed = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                streamed += delta.function.arguments or ""
    assert json.loads(streamed) == arguments
