"""A prompt of token ids that ends inside a character (the first bytes of an emoji):
through the HTTP API, streamed deltas hold only generated text and add up to the whole
answer, which is vLLM's text (the decode of prompt + output minus the prompt's decode:
the character the prompt began is the prompt's)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from router.tokenizer import Tokenizer
from tests.byte_tokens import byte_tokens
from tests.unit.api.conftest import AppFactory, ids_script, sse_data


async def completion(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    """(whole text, streamed text) of one greedy ``/v1/completions`` request."""
    whole = await client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(d) for d in sse_data(streamed.text) if d != "[DONE]"]
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert all("Hi" not in delta and "\ufffd" not in delta for delta in deltas), deltas
    return whole.json()["choices"][0]["text"], "".join(deltas)


@pytest.mark.parametrize("extra", [{}, {"stop": ["never"]}, {"logprobs": 1}])
async def test_prompt_ending_inside_an_emoji(
    make_app: AppFactory, tokenizer: Tokenizer, extra: dict[str, Any]
) -> None:
    smile = byte_tokens(tokenizer, "🙂")
    prompt = tokenizer.encode("Hi ", add_special_tokens=False) + smile[:2]
    eos = min(tokenizer.eos_token_ids)
    output = smile[2:] + tokenizer.encode(" ok 🙂", add_special_tokens=False) + [eos]
    client, _, _ = await make_app(ids_script(output))
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    whole, streamed = await completion(client, body)
    assert whole == streamed == " ok 🙂"
    # cut by max_tokens right after the prompt's emoji: nothing was generated as text
    whole, streamed = await completion(client, {**body, "max_tokens": 2})
    assert whole == streamed == ""
