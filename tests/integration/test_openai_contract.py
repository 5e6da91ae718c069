"""The OpenAI routes keep OpenAI's contract, through the ``openai`` package against the
real server on the tiny model: unsupported fields are refused by name, an unknown model
is a 404, errors name OpenAI's fields, ``echo`` with ``logprobs`` covers the prompt,
JSON types are strict, 429 carries Retry-After, refused requests are counted, and stream
chunks carry each choice's finish_reason and logprobs (null until set)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from router.pb import generate_pb2, generate_pb2_grpc
from router.tokenizer import Tokenizer
from tests.byte_tokens import byte_tokens
from tests.integration.live_server import LiveServer, launch_tiny

NAMES = ["tiny-a", "tiny-b"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("openai") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--served-model-name", *NAMES])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def bad_request(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as failure:
        call()
    return failure.value


def param(error: openai.APIStatusError) -> str | None:
    body = error.body
    assert isinstance(body, dict), body
    value = body.get("param")
    return value if isinstance(value, str) or value is None else str(value)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
UNSUPPORTED_CHAT = [
    ("functions", [TOOL["function"]]),
    ("function_call", "auto"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("logit_bias", {"1": 5}),
    ("prediction", {"type": "content", "content": "x"}),
]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_400_naming_the_field(
    client: openai.OpenAI, field: str, value: object
) -> None:
    error = bad_request(lambda: client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, max_tokens=2, extra_body={field: value}))
    assert param(error) == field and field in error.message


@pytest.mark.parametrize(("field", "value"), [
    ("suffix", " world"), ("logit_bias", {"1": 5}), ("tools", [TOOL]),
])
def test_unsupported_completion_fields_are_400_naming_the_field(
    client: openai.OpenAI, field: str, value: object
) -> None:
    error = bad_request(lambda: client.completions.create(
        model=NAMES[0], prompt=PROMPT, max_tokens=2, extra_body={field: value}))
    assert param(error) == field and field in error.message


def test_off_values_of_unsupported_fields_are_accepted(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, max_tokens=2, tool_choice="none",
        response_format={"type": "text"}, extra_body={"tools": [], "logit_bias": {}})
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_served_names_and_unknown_model(client: openai.OpenAI, server: LiveServer) -> None:
    assert [model.id for model in client.models.list().data] == NAMES
    for name in NAMES:
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert completion.model == NAMES[0]  # vLLM: responses carry the first name
    with pytest.raises(openai.NotFoundError) as failure:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert param(failure.value) == "model" and "gpt-4o" in failure.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert httpx.get(f"{server.url}/info", timeout=10).json()["model_id"] == NAMES[0]


def test_errors_name_openai_fields(client: openai.OpenAI) -> None:
    error = bad_request(lambda: client.completions.create(
        model=NAMES[0], prompt=PROMPT, max_tokens=600))
    assert param(error) == "max_tokens", error.message
    assert "max_tokens" in error.message and "max_new_tokens" not in error.message
    error = bad_request(lambda: client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, max_completion_tokens=600))  # type: ignore[arg-type]
    assert param(error) == "max_completion_tokens"
    assert "max_new_tokens" not in error.message
    error = bad_request(lambda: client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, max_tokens=600))  # type: ignore[arg-type]
    assert param(error) == "max_tokens" and "max_new_tokens" not in error.message
    error = bad_request(lambda: client.completions.create(
        model=NAMES[0], prompt=PROMPT, max_tokens=2, extra_body={"stop_token_ids": [10**9]}))
    assert param(error) == "stop_token_ids"


def prompt_details(server: LiveServer) -> list[dict[str, Any]]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "decoder_input_details": True,
                                             "details": True}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    prefill: list[dict[str, Any]] = response.json()["details"]["prefill"]
    return prefill


def test_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI, server: LiveServer) -> None:
    prefill = prompt_details(server)
    completion = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=3,
                                           temperature=0, echo=True, logprobs=1,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.text_offset and logprobs.top_logprobs
    n = len(prefill)
    assert len(logprobs.tokens) == n + 3
    assert logprobs.tokens[:n] == [token["text"] for token in prefill]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for got, token in zip(logprobs.token_logprobs[1:n], prefill[1:], strict=True):
        assert got == pytest.approx(token["logprob"], abs=1e-4)
    # Offsets point into the echoed text: each prompt token's text is found there.
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for i in range(n):
        assert choice.text[offsets[i]:].startswith(logprobs.tokens[i])
    assert offsets[n] == len(PROMPT)
    # Streaming: the first chunk of the choice carries the prompt tokens too.
    stream = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=1, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    first = chunks[0].logprobs
    assert first is not None and first.tokens and first.token_logprobs and first.text_offset
    assert first.tokens[:n] == logprobs.tokens[:n] and first.token_logprobs[0] is None
    streamed_offsets = [o for chunk in chunks for o in (chunk.logprobs.text_offset or [])]  # type: ignore[union-attr]
    assert streamed_offsets == offsets
    assert "".join(chunk.text for chunk in chunks) == choice.text


STRICT_BODIES = [
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": True}}, "max_new_tokens"),
    ("/generate", {"inputs": "Hi", "parameters": {"temperature": "0.5"}}, "temperature"),
    ("/generate", {"inputs": "Hi", "parameters": {"details": 1}}, "details"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": True}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "0"}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": "true"}, "stream"),
]


@pytest.mark.parametrize(("path", "body", "field"), STRICT_BODIES)
def test_json_types_are_strict(server: LiveServer, path: str, body: dict[str, Any],
                               field: str) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code in (400, 422), response.text
    assert field in response.text


def test_json_integers_are_accepted_for_numbers(server: LiveServer) -> None:
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "temperature": 1,
                                           "top_p": 1, "do_sample": True}}
    assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200


def rejected(server: LiveServer) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('shardserve_requests_total{outcome="rejected"}'):
            return float(line.split()[-1])
    return 0.0


def test_refused_requests_count_as_rejected(client: openai.OpenAI, server: LiveServer) -> None:
    before = rejected(server)
    bad_request(lambda: client.chat.completions.create(
        model=NAMES[0], messages=MESSAGES, max_tokens=2,
        extra_body={"functions": [TOOL["function"]]}))
    bad_request(lambda: client.completions.create(model=NAMES[0], prompt=PROMPT,
                                                  max_tokens=600))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    response = httpx.post(f"{server.url}/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": "5"}}, timeout=10)
    assert response.status_code == 422
    assert rejected(server) == before + 4


@pytest.fixture(scope="module")
def busy_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("busy") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--max-concurrent-requests", "1"])
    yield live
    live.stop()


def test_429_carries_retry_after(busy_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{busy_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the long request is running
    with pytest.raises(openai.RateLimitError) as failure:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    retry_after = failure.value.response.headers.get("retry-after")
    assert retry_after is not None and int(retry_after) >= 1
    stream.close()
    # Once the long request is gone the server accepts again.
    deadline = time.monotonic() + 10
    while True:
        try:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            threading.Event().wait(0.1)


def test_completion_top_logprobs_include_the_sampled_token(client: openai.OpenAI) -> None:
    """OpenAI's legacy ``logprobs``: the logprob of the sampled token is always returned,
    so ``top_logprobs`` holds up to ``logprobs + 1`` entries."""
    completion = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=16,
                                           temperature=1.0, seed=3, logprobs=1,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs and logprobs.tokens
    assert logprobs.token_logprobs is not None
    outside_top = 0
    for token, logprob, tops in zip(logprobs.tokens, logprobs.token_logprobs,
                                    logprobs.top_logprobs, strict=True):
        assert tops is not None and 1 <= len(tops) <= 2
        assert tops[token] == pytest.approx(logprob)
        outside_top += len(tops) == 2
    assert outside_top, "every sampled token was the most likely: sample more"


def _sse_chunks(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_choices_carry_finish_reason_and_logprobs_null_until_set(
        server: LiveServer, path: str) -> None:
    """As OpenAI's chunks: every choice has ``finish_reason`` and ``logprobs`` (null
    until set); a chat delta carries only its fields that are set."""
    body: dict[str, Any] = {"model": NAMES[0], "max_tokens": 4, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    choices = [c for chunk in _sse_chunks(server, path, body) for c in chunk["choices"]]
    assert len(choices) >= 4
    for choice in choices:
        assert "finish_reason" in choice and "logprobs" in choice, choice
        assert choice["logprobs"] is None
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    if "chat" in path:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(None not in c["delta"].values() for c in choices)


def test_prompt_ids_ending_inside_a_character_stream_as_whole(
        server: LiveServer, tokenizer: Tokenizer) -> None:
    """A token-id prompt cut inside an emoji: the greedy answer streamed equals the
    answer sent whole, and no delta carries the prompt's text."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False) + byte_tokens(tokenizer, "🙂")[:2]
    body: dict[str, Any] = {"model": NAMES[0], "prompt": prompt, "max_tokens": 12,
                            "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    whole = response.json()["choices"][0]["text"]
    deltas = [c["choices"][0]["text"] for c in
              _sse_chunks(server, "/v1/completions", {**body, "stream": True}) if c["choices"]]
    assert "".join(deltas) == whole
    assert not any("capital" in delta for delta in deltas), deltas


def test_grpc_takes_every_uint64_seed_as_http_does(server: LiveServer) -> None:
    """Seeds above 2^63 - 1 (the proto's uint64) sample as on /generate with that seed."""
    texts = {}
    for seed in (2**63 + 7, 2**64 - 1):
        params = generate_pb2.Parameters(max_new_tokens=8, do_sample=True, seed=seed,
                                         ignore_eos=True)
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            reply = stub.Generate(generate_pb2.GenerateRequest(inputs=PROMPT, parameters=params),
                                  timeout=60)
        assert reply.sequence.seed == seed
        http = httpx.post(f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 8, "do_sample": True, "seed": seed, "ignore_eos": True,
            "details": True}}, timeout=60).json()
        assert http["details"]["seed"] == seed
        assert reply.sequence.generated_text == http["generated_text"]
        texts[seed] = http["generated_text"]
    assert len(set(texts.values())) == 2, texts  # the high bits of the seed count


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_CHATS = [
    ({"messages": [*MESSAGES, {"role": "user", "content": None}]}, "messages[1].content"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "content": "ok"}]}, "messages[2].tool_call_id"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "#/$defs/Missing"}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": f"f{i}", "description": "word " * 100}} for i in range(8)]}, "tools"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CHATS)
def test_bad_chat_fields_are_400_naming_the_field(
        server: LiveServer, body: dict[str, Any], field: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"model": NAMES[0], "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text
