"""CASES "Sampling" (P1-P5) through the HTTP API: router app → engine → a real gRPC shard
serving the tiny fp32 random Llama (the sampler of shard/sampling.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from router.api.app import ServerState, create_app
from router.config import SchedulerConfig, ValidationLimits
from router.engine.loop import Engine
from router.shard_client import ShardClient
from router.tokenizer import Tokenizer
from router.validation import Validator

PROMPT = "Once upon a time"


@pytest.fixture
async def client(tiny_shard_address: str, tiny_model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    shard = ShardClient([tiny_shard_address])
    await shard.wait_ready(30)
    num_blocks = await shard.warmup(256, 512)
    info = (await shard.info())[0]
    config = SchedulerConfig(max_batch_prefill_tokens=256, max_input_tokens=128,
                             max_total_tokens=512)
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    engine = Engine(shard, tokenizer, config, num_blocks, info.block_size)
    engine.start()
    validator = Validator(tokenizer, engine.scheduler, ValidationLimits(max_best_of=4))
    state = ServerState(engine, validator, "tiny", "float32", "cpu", 1, "torch", "test")
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as http:
        yield http
    await engine.stop()
    await shard.close()


async def token_ids(client: httpx.AsyncClient, prompt: str = PROMPT, **params: object) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "ignore_eos": True,
                                             "details": True, **params}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


async def test_temperature_zero_top_k_one_and_greedy_agree_p1(client: httpx.AsyncClient) -> None:
    greedy = await token_ids(client)
    assert await token_ids(client, do_sample=True, top_k=1, seed=3) == greedy
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    completion = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert len(completion["logprobs"]["tokens"]) == 12
    tgi = (await client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "ignore_eos": True}})).json()["generated_text"]
    assert completion["text"] == tgi
    # temperature 0 stays greedy whatever warpers come with it.
    for warper in ({"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}, {"typical_p": 0.9}):
        warped = (await client.post("/v1/completions", json={**body, **warper})).json()
        assert warped["choices"][0]["text"] == tgi, warper


async def test_seed_reproduces_and_really_samples_p2(client: httpx.AsyncClient) -> None:
    greedy = await token_ids(client)
    first = await token_ids(client, do_sample=True, temperature=1.0, seed=5)
    assert await token_ids(client, do_sample=True, temperature=1.0, seed=5) == first
    others = [await token_ids(client, do_sample=True, temperature=1.0, seed=s) for s in (6, 7)]
    assert any(other != first for other in others), "other seeds should give other text"
    assert any(sample != greedy for sample in [first, *others]), "sampling must not be greedy"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "seed": 11,
            "ignore_eos": True}
    texts = [(await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
             ["message"]["content"] for _ in range(2)]
    assert texts[0] == texts[1]


async def test_seeded_row_independent_of_neighbours_p3(client: httpx.AsyncClient) -> None:
    alone = await token_ids(client, do_sample=True, seed=42)
    together = await asyncio.gather(
        token_ids(client, do_sample=True, seed=42),
        token_ids(client, "A different prompt entirely", do_sample=True),
        token_ids(client, "Yet another", do_sample=True, seed=43, top_p=0.9),
        token_ids(client, PROMPT, do_sample=True, seed=44),
    )
    assert together[0] == alone


async def test_mixed_batch_rows_equal_their_solo_runs_p4(client: httpx.AsyncClient) -> None:
    rows: list[dict[str, object]] = [
        {},
        {"do_sample": True, "top_k": 5, "seed": 1},
        {"do_sample": True, "top_p": 0.8, "seed": 2},
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"do_sample": True, "min_p": 0.1, "typical_p": 0.9, "temperature": 0.7, "seed": 3},
    ]
    alone = [await token_ids(client, **row) for row in rows]
    together = await asyncio.gather(*(token_ids(client, **row) for row in rows))
    assert list(together) == alone


async def test_top_n_with_top_p_returns_model_logprobs_p5(client: httpx.AsyncClient) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "ignore_eos": True,
                                             "details": True, "top_n_tokens": 3}}
    greedy = (await client.post("/generate", json=body)).json()["details"]
    body["parameters"].update(do_sample=True, top_p=0.3, temperature=0.5, seed=9)  # type: ignore[attr-defined]
    sampled = (await client.post("/generate", json=body)).json()["details"]
    for details in (greedy, sampled):
        assert all(len(tops) == 3 for tops in details["top_tokens"])
        for token, tops in zip(details["tokens"], details["top_tokens"], strict=True):
            logprobs = [t["logprob"] for t in tops]
            assert logprobs == sorted(logprobs, reverse=True)
            assert math.log(sum(math.exp(lp) for lp in logprobs)) <= 1e-5
            if token["id"] in [t["id"] for t in tops]:
                match = next(t for t in tops if t["id"] == token["id"])
                assert match["logprob"] == pytest.approx(token["logprob"], abs=1e-5)
    # Logprobs are those of the model, before temperature: the first step (same prompt,
    # nothing generated yet) has the same alternatives whatever the sampling settings.
    assert sampled["top_tokens"][0] == greedy["top_tokens"][0]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_p": 0.2,
            "logprobs": True, "top_logprobs": 4}
    content = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0][
        "logprobs"]["content"]
    assert all(len(token["top_logprobs"]) == 4 for token in content)
