"""CASES "API details" (A1-A3) and response shapes, through the HTTP API with a scripted
shard."""

from __future__ import annotations

import json

from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, ids_script, sse_data, text_script


async def test_prompt_logprobs_one_per_prompt_token_a1(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " ok"))
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    for _ in range(2):  # the second time the prompt is in the prefix cache
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 2,
                                                 "decoder_input_details": True}}
        response = await client.post("/generate", json=body)
        prefill = response.json()["details"]["prefill"]
        assert [t["id"] for t in prefill] == ids
        assert prefill[0].get("logprob") is None
        assert all(isinstance(t["logprob"], float) for t in prefill[1:])
        assert [t["text"] for t in prefill][:2] == ["The", " capital"]


async def test_best_of_and_n_give_exactly_that_many_choices_a2(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, " a b c"))
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "best_of": 2, "seed": 7,
                                           "do_sample": True, "details": True}}
    details = (await client.post("/generate", json=body)).json()["details"]
    assert len(details["best_of_sequences"]) == 1
    assert {details["seed"], details["best_of_sequences"][0]["seed"]} == {7, 8}
    assert sorted(r.sampling.seed for r in shard.prefilled[-2:]) == [7, 8]
    for stream in (False, True):
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2,
                "stream": stream}
        response = await client.post("/v1/chat/completions", json=chat)
        if stream:
            chunks = [json.loads(d) for d in sse_data(response.text)[:-1]]
            indexes = {c["choices"][0]["index"] for c in chunks}
            finished = [c["choices"][0]["index"] for c in chunks
                        if c["choices"][0].get("finish_reason")]
            assert indexes == {0, 1} and sorted(finished) == [0, 1]
        else:
            assert [c["index"] for c in response.json()["choices"]] == [0, 1]
        completion = {"prompt": ["x", "y"], "max_tokens": 3, "n": 2, "stream": stream}
        response = await client.post("/v1/completions", json=completion)
        if stream:
            chunks = [json.loads(d) for d in sse_data(response.text)[:-1]]
            assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
        else:
            assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]


async def test_ignore_eos_gives_exactly_max_new_tokens_a3(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    eos = min(tokenizer.eos_token_ids)
    client, _, _ = await make_app(ids_script([eos]))
    early = await client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 7, "details": True}})
    assert early.json()["details"]["finish_reason"] == "eos_token"
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 7, "ignore_eos": True,
                                           "details": True}}
    details = (await client.post("/generate", json=body)).json()["details"]
    assert details["generated_tokens"] == 7 and len(details["tokens"]) == 7
    assert details["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "ignore_eos": True}
    response = (await client.post("/v1/chat/completions", json=chat)).json()
    assert response["usage"]["completion_tokens"] == 5
    assert response["choices"][0]["finish_reason"] == "length"


async def test_openai_shapes_usage_and_logprobs(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " Paris"))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}
    data = sse_data((await client.post("/v1/chat/completions", json=body)).text)
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    token = json.loads(data[1])["choices"][0]["logprobs"]["content"][0]
    assert token["token"] == " Paris" and len(token["top_logprobs"]) == 2
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "scripted/model"


async def test_chat_template_has_bos_once(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, shard, _ = await make_app(text_script(tokenizer, " ok"))
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    ids = list(shard.prefilled[-1].input_ids)
    bos_id = tokenizer.backend.token_to_id(tokenizer.bos_token)
    assert ids[0] == bos_id and ids[1] != bos_id
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_tokenize_and_openapi(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " ok"))
    tokens = (await client.post("/tokenize", json={"inputs": "Hello world"})).json()
    assert [t["id"] for t in tokens] == tokenizer.encode("Hello world")
    assert tokens[1]["text"] == " world" and tokens[1]["start"] == 5
    paths = (await client.get("/openapi.json")).json()["paths"]
    for path in ("/generate", "/generate_stream", "/tokenize", "/v1/completions",
                 "/v1/chat/completions", "/v1/models", "/info", "/health"):
        assert path in paths
    assert (await client.get("/docs")).status_code == 200
