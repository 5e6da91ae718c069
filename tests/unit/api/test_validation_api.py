"""CASES "Validation" (V1-V7) on every endpoint: each bad value is a 4xx naming the field,
nothing reaches the shards, and the next plain request works."""

from __future__ import annotations

import httpx
import pytest

from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, text_script


async def plain_request_works(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", json={"inputs": "Hi",
                                                    "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200, response.text


def tgi(parameters: dict[str, object], inputs: object = "Hello") -> tuple[str, dict]:
    return "/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 3, **parameters}}


def chat(**fields: object) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 3, **fields}


def completion(**fields: object) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "Hi", "max_tokens": 3, **fields}


async def assert_rejected(client: httpx.AsyncClient, path: str, body: object, field: str,
                          raw: bytes | None = None) -> None:
    kwargs = {"content": raw, "headers": {"Content-Type": "application/json"}} if raw else {
        "json": body}
    response = await client.post(path, **kwargs)  # type: ignore[arg-type]
    if path.startswith("/v1/"):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert field in error["message"]
    else:
        assert response.status_code == 422, response.text
        assert response.json()["error_type"] == "validation"
        assert field in response.json()["error"]
    await plain_request_works(client)


@pytest.fixture
async def client(make_app: AppFactory, tokenizer: Tokenizer) -> httpx.AsyncClient:
    client, shard, _ = await make_app(text_script(tokenizer, " fine thanks"))
    client.shard = shard  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize("value", [1.0, 0.5])
async def test_top_p_and_typical_p_accepted_v1(client: httpx.AsyncClient, value: float) -> None:
    for path, body in (tgi({"top_p": value, "typical_p": value}), chat(top_p=value),
                       completion(top_p=value, typical_p=value)):
        assert (await client.post(path, json=body)).status_code == 200


async def test_top_p_one_is_off_v1(client: httpx.AsyncClient) -> None:
    await client.post("/generate", json=tgi({"top_p": 1.0, "typical_p": 1.0})[1])
    sent = client.shard.prefilled[-1].sampling  # type: ignore[attr-defined]
    assert sent.top_p == 1.0 and sent.typical_p == 1.0 and not sent.do_sample


@pytest.mark.parametrize("value", [0, -0.5, 1.5])
@pytest.mark.parametrize("name", ["top_p", "typical_p"])
async def test_top_p_out_of_range_rejected_v1(
    client: httpx.AsyncClient, name: str, value: float
) -> None:
    await assert_rejected(client, *tgi({name: value}), field=name)
    await assert_rejected(client, *completion(**{name: value}), field=name)


@pytest.mark.parametrize("top_k", [0, -1, None])
async def test_top_k_off_values_mean_the_same_everywhere_v2(
    client: httpx.AsyncClient, top_k: int | None
) -> None:
    shard = client.shard  # type: ignore[attr-defined]
    for path, body in (tgi({"top_k": top_k, "do_sample": True, "seed": 1}),
                       chat(top_k=top_k, seed=1), completion(top_k=top_k, seed=1)):
        assert (await client.post(path, json=body)).status_code == 200
        assert shard.prefilled[-1].sampling.top_k == 0
    await assert_rejected(client, *tgi({"top_k": -2}), field="top_k")


@pytest.mark.parametrize(
    ("path_body", "field"),
    [
        (tgi({"repetition_penalty": 0}), "repetition_penalty"),
        (tgi({"repetition_penalty": -1.0}), "repetition_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
    ],
)
async def test_non_positive_repetition_penalty_rejected_v3(
    client: httpx.AsyncClient, path_body: tuple[str, dict], field: str
) -> None:
    await assert_rejected(client, *path_body, field=field)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    ("path", "template", "field"),
    [
        ("/generate", '{"inputs": "Hi", "parameters": {"temperature": %s}}', "temperature"),
        ("/generate", '{"inputs": "Hi", "parameters": {"repetition_penalty": %s}}',
         "repetition_penalty"),
        ("/generate", '{"inputs": "Hi", "parameters": {"frequency_penalty": %s}}',
         "frequency_penalty"),
        ("/v1/completions", '{"prompt": "Hi", "top_p": %s}', "top_p"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "x"}], "presence_penalty": %s}',
         "presence_penalty"),
    ],
)
async def test_nan_and_infinity_rejected_anywhere_v3(
    client: httpx.AsyncClient, number: str, path: str, template: str, field: str
) -> None:
    before = len(client.shard.prefilled)  # type: ignore[attr-defined]
    await assert_rejected(client, path, None, field, raw=(template % number).encode())
    assert len(client.shard.prefilled) == before + 1  # only the plain request  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path_body", "field"),
    [(tgi({}, inputs=""), "inputs"), (completion(prompt=""), "prompt"),
     (completion(prompt=[]), "prompt"), (chat(messages=[]), "messages")],
)
async def test_empty_prompt_rejected_v4(
    client: httpx.AsyncClient, path_body: tuple[str, dict], field: str
) -> None:
    await assert_rejected(client, *path_body, field=field)


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        ("/generate", b'{"inputs": "hi", "parameters": {', "body"),
        ("/v1/chat/completions", b'{"messages": [', "body"),
        ("/generate", b'{"inputs": 3}', "inputs"),
        ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": "many"}}',
         "max_new_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
        ("/v1/completions", b'{"prompt": "x", "n": "two"}', "n"),
        ("/v1/completions", b'[1, 2]', "body"),
    ],
)
async def test_malformed_bodies_are_4xx_with_json_v5(
    client: httpx.AsyncClient, path: str, raw: bytes, field: str
) -> None:
    await assert_rejected(client, path, None, field, raw=raw)


async def test_truncate_keeps_the_last_tokens_v6(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(100))  # > max_input_tokens=64
    ids = tokenizer.encode(long_prompt)
    await assert_rejected(client, *tgi({}, inputs=long_prompt), field="max_input_tokens=64")
    response = await client.post("/generate", json=tgi({"truncate": 10}, inputs=long_prompt)[1])
    assert response.status_code == 200
    sent = client.shard.prefilled[-1]  # type: ignore[attr-defined]
    assert list(sent.input_ids) == ids[-10:]
    chat_ok = await client.post("/v1/completions", json=completion(prompt=long_prompt,
                                                                   truncate=10)[1])
    assert chat_ok.status_code == 200
    assert list(client.shard.prefilled[-1].input_ids) == ids[-10:]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path_body", "field"),
    [(tgi({"max_new_tokens": 0}), "max_new_tokens"), (completion(max_tokens=0), "max_tokens"),
     (chat(max_tokens=0), "max_tokens"), (chat(max_completion_tokens=0), "max_completion_tokens")],
)
async def test_zero_max_new_tokens_is_a_clean_4xx_v7(
    client: httpx.AsyncClient, path_body: tuple[str, dict], field: str
) -> None:
    await assert_rejected(client, *path_body, field=field)


@pytest.mark.parametrize(
    ("path_body", "field"),
    [
        (tgi({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (tgi({"top_n_tokens": 21}), "top_n_tokens"),
        (tgi({"best_of": 17, "do_sample": True}), "best_of"),
        (tgi({"best_of": 2}), "best_of"),
        (completion(n=17), "n"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (tgi({"stop_token_ids": [10**9]}), "stop_token_ids"),
        (tgi({"seed": 2**64}), "seed"),
        (completion(logit_bias={"1": 5.0}), "logit_bias"),
        (tgi({"watermark": True}), "watermark"),
    ],
)
async def test_limits_are_flags_and_named(
    client: httpx.AsyncClient, path_body: tuple[str, dict], field: str
) -> None:
    await assert_rejected(client, *path_body, field=field)


async def test_chat_top_logprobs_follow_the_flag_and_name_it(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    from router.config import ValidationLimits

    client, _, _ = await make_app(text_script(tokenizer, " fine thanks"),
                                  ValidationLimits(max_top_n_tokens=25))
    path, body = chat(logprobs=True, top_logprobs=22)
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 22
    path, body = chat(logprobs=True, top_logprobs=26)
    response = await client.post(path, json=body)
    assert response.status_code == 400
    assert "--max-top-n-tokens" in response.json()["error"]["message"]


async def test_length_limits_name_their_flags(client: httpx.AsyncClient) -> None:
    too_long = " ".join(f"word{i}" for i in range(100))
    for path, body, flag in (
        (*tgi({}, inputs=too_long), "--max-input-tokens"),
        (*tgi({"max_new_tokens": 10_000}), "--max-total-tokens"),
    ):
        response = await client.post(path, json=body)
        assert response.status_code == 422, response.text
        assert flag in response.json()["error"], response.json()
