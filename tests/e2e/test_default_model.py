"""The default model served end to end: Ray → gRPC shard → paged KV cache → HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference_text(default_model_dir: Path) -> str:
    """transformers' greedy continuation (float32, 20 new tokens) of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return str(tokenizer.decode(new_tokens, skip_special_tokens=True))


def generate(base_url: str, inputs: str, **parameters: object) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 20, **parameters}}
    return httpx.post(f"{base_url}/generate", json=body, timeout=300)


def stream_texts(base_url: str, inputs: str, **parameters: object) -> list[dict[str, object]]:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 20, **parameters}}
    events = []
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


def test_greedy_matches_transformers(ray_server: str, reference_text: str) -> None:
    response = generate(ray_server, PROMPT, details=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["generated_text"] == reference_text
    assert body["details"]["generated_tokens"] == 20
    assert body["details"]["finish_reason"] == "length"


def test_stream_joined_equals_generate(ray_server: str, reference_text: str) -> None:
    events = stream_texts(ray_server, PROMPT)
    assert len(events) == 20
    joined = "".join(str(event["token"]["text"]) for event in events)  # type: ignore[index]
    assert joined == reference_text
    assert events[-1]["generated_text"] == reference_text
    assert all(event["generated_text"] is None for event in events[:-1])


def test_concurrent_requests_complete(ray_server: str, reference_text: str) -> None:
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [
                {"inputs": PROMPT, "parameters": {"max_new_tokens": 20}},
                {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12}},
            ]
            return list(
                await asyncio.gather(
                    *(client.post(f"{ray_server}/generate", json=b) for b in bodies)
                )
            )

    first, second = asyncio.run(both())
    assert first.status_code == 200 and second.status_code == 200
    assert first.json()["generated_text"] == reference_text
    assert len(second.json()["generated_text"]) > 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": "", "parameters": {}}, "inputs"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": -3}}, "max_new_tokens"),
        ({"inputs": "hi", "parameters": {"top_p": 0}}, "top_p"),
        ({"inputs": "hi", "parameters": {"temperature": "hot"}}, "temperature"),
        ({"parameters": {}}, "inputs"),
    ],
)
def test_bad_input_names_the_field(ray_server: str, body: dict[str, object], field: str) -> None:
    response = httpx.post(f"{ray_server}/generate", json=body, timeout=30)
    assert response.status_code == 422
    error = response.json()
    assert error["error_type"] == "validation"
    assert field in error["error"]
    assert generate(ray_server, PROMPT, max_new_tokens=2).status_code == 200


def test_malformed_json_is_a_4xx(ray_server: str) -> None:
    response = httpx.post(
        f"{ray_server}/generate",
        content=b'{"inputs": "hi", "parameters": {',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 422
    assert "body" in response.json()["error"]
    assert generate(ray_server, PROMPT, max_new_tokens=2).status_code == 200


def test_info_and_blocks_return_to_baseline(ray_server: str) -> None:
    info = httpx.get(f"{ray_server}/info", timeout=30).json()
    for key in ("model_id", "num_shard", "attention_backend", "block_size",
                "kv_blocks_total", "kv_blocks_free"):
        assert key in info
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["num_shard"] == 1 and info["attention_backend"] == "torch"
    baseline = info["kv_blocks_free"]
    assert baseline == info["kv_blocks_total"]
    for max_new_tokens in (1, 5, 33):
        assert generate(ray_server, PROMPT * 3, max_new_tokens=max_new_tokens).status_code == 200
    stream_texts(ray_server, PROMPT, max_new_tokens=17)
    assert httpx.get(f"{ray_server}/info", timeout=30).json()["kv_blocks_free"] == baseline


def test_health(ray_server: str) -> None:
    assert httpx.get(f"{ray_server}/health", timeout=30).status_code == 200
