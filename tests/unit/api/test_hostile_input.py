"""Hostile HTTP input: invalid Unicode, unparsable and oversized bodies — each a 4xx in
the route's error shape, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from router.tokenizer import Tokenizer
from router.validation import ValidationLimits
from tests.unit.api.conftest import AppFactory, text_script

SURROGATE_BODIES = [
    ("/generate", '{"inputs": "a\\ud800"}', "inputs"),
    ("/tokenize", '{"inputs": "a\\ud800"}', "inputs"),
    ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', "messages"),
    ("/generate", '{"inputs": "a", "parameters": {"stop": ["ok", "\\ud800"]}}', "stop[1]"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "stop": "x\\udfff"}', "stop[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
     '"max_tokens": 2, "stop": ["\\ud800"]}', "stop[0]"),
]


@pytest.mark.parametrize(("path", "body", "field"), SURROGATE_BODIES)
async def test_lone_surrogate_is_a_4xx_naming_the_field(
    make_app: AppFactory, tokenizer: Tokenizer, path: str, body: str, field: str
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code in (400, 422), response.text
    assert field in response.text
    ok = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


async def test_unparsable_body_uses_our_error_shape(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post("/generate", content=b'{"inputs": "\xff\xfe"}',
                                 headers={"content-type": "application/json"})
    assert response.status_code == 422  # invalid input, as a truncated body is
    assert response.json()["error"].startswith("body")
    truncated = await client.post("/generate", content=b'{"inputs": "Hi"',
                                  headers={"content-type": "application/json"})
    assert truncated.status_code == 422
    response = await client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_oversized_body_is_413(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    big = {"inputs": "hello world " * 200_000}  # 2.4 MB > the 1 MiB default
    response = await client.post("/generate", json=big)
    assert response.status_code == 413
    assert "--max-request-bytes" in response.json()["error"]
    ok = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


async def _chunks(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_oversized_body_on_an_openai_route_is_an_openai_413(
    make_app: AppFactory, tokenizer: Tokenizer, chunked: bool
) -> None:
    """Up front (``Content-Length``) and while a chunked body arrives, the 413 on a
    ``/v1/`` route has OpenAI's error shape naming the body, as the TGI routes have
    theirs; the server keeps serving."""
    client, _, _ = await make_app(text_script(tokenizer, " fine"), max_request_bytes=50_000)
    data = json.dumps({"prompt": "hello world " * 10_000, "max_tokens": 2}).encode()
    content = _chunks(data) if chunked else data
    response = await client.post("/v1/completions", content=content,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert ("content-length" in response.request.headers) is not chunked
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "body"
    assert "--max-request-bytes" in error["message"]
    tgi = await client.post("/generate", content=_chunks(data) if chunked else data,
                            headers={"content-type": "application/json"})
    assert tgi.status_code == 413
    assert tgi.json()["error_type"] == "validation"
    assert tgi.json()["error"].startswith("body: ")
    ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_text_far_beyond_the_token_limit_is_rejected_before_tokenizing(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    text = "a" * (64 * tokenizer.max_token_chars + 1)  # max_input_tokens is 64 here
    response = await client.post("/generate", json={"inputs": text})
    assert response.status_code == 422 and "characters" in response.json()["error"]


async def test_draining_server_refuses_new_requests_with_503(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, engine = await make_app(text_script(tokenizer, " fine"))
    engine.drain()
    response = await client.post("/generate", json={"inputs": "Hi"})
    assert response.status_code == 503 and "shutting down" in response.json()["error"]
    assert (await client.get("/health")).status_code == 503


async def test_a_call_cancelled_under_a_route_is_a_json_500(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    import asyncio

    client, _, engine = await make_app(text_script(tokenizer, " fine"))

    def cancelled() -> str:
        raise asyncio.CancelledError  # as an RPC cancelled by a closing channel raises

    engine.metrics.render = cancelled  # type: ignore[method-assign]
    response = await client.get("/metrics")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: a call was cancelled",
                               "error_type": "internal"}
    assert (await client.get("/health")).status_code == 200  # still serving


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": None, "max_tokens": 2}, "prompt"),
    ({"prompt": "Hi", "max_tokens": "two"}, "max_tokens"),
])
async def test_openai_param_names_the_field_not_a_union_branch(
    make_app: AppFactory, tokenizer: Tokenizer, body: dict[str, object], param: str
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    chat = {"messages": [{"role": "user", "content": 5}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content"


async def test_wrong_method_on_an_openai_route_is_a_request_error(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.get("/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_more_sequences_than_ever_run_at_once_is_a_4xx_not_a_429(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    """A request whose sequences (prompts x n, or best_of) exceed
    --max-concurrent-requests could never be admitted: a 4xx naming the field, not a 429
    inviting retries; one that fits is served."""
    client, _, _ = await make_app(text_script(tokenizer, " fine"),
                                  ValidationLimits(max_best_of=8), max_concurrent_requests=2)
    response = await client.post("/v1/completions",
                                 json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "--max-concurrent-requests" in error["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3,
            "temperature": 1.0}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert "--max-concurrent-requests" in response.json()["error"]["message"]
    tgi = {"inputs": "Hi", "parameters": {"best_of": 3, "do_sample": True, "max_new_tokens": 2}}
    response = await client.post("/generate", json=tgi)
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("best_of")
    assert "--max-concurrent-requests" in response.json()["error"]
    ok = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 2


@pytest.mark.parametrize(("path", "status"), [("/generate", 422), ("/v1/completions", 400)])
async def test_body_of_another_media_type_says_so(
    make_app: AppFactory, tokenizer: Tokenizer, path: str, status: int
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post(path, content=b'{"inputs": "Hi", "prompt": "Hi"}',
                                 headers={"content-type": "text/plain"})
    assert response.status_code == status, response.text
    assert "Content-Type: application/json (got text/plain)" in response.text


async def test_too_many_prompts_names_the_limit(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post("/v1/completions", json={
        "prompt": ["a"] * 100, "n": 2, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert "100 prompts x 2 choices" in response.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status", "error_type"), [
    ("GET", "/generate", 405, "method_not_allowed"),
    ("POST", "/no-such-route", 404, "not_found"),
])
async def test_unknown_route_or_method_names_no_field(
    make_app: AppFactory, tokenizer: Tokenizer, method: str, path: str, status: int,
    error_type: str,
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.request(method, path)
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type, response.text
    openai = await client.request(method, "/v1/no-such-route")
    assert openai.status_code == 404 and openai.json()["error"]["param"] is None
