"""A stream handler keeps no per-token event objects while it streams: a long stream's
events held to its end would all be scanned by every full collection of the garbage
collector, a pause of the whole router (tested by counting the live events mid-stream)."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

from router.request import TokenEvent
from tests.unit.api.conftest import AppFactory, ids_script, sse_data

TOKENS = 60
SAMPLED_AT = 40  # decode step at which the live events are counted


def _count_events_at_step(shard: Any) -> list[int]:
    """Count the live TokenEvents when the shard group is asked for step SAMPLED_AT."""
    counts: list[int] = []
    decode = shard.decode
    steps = 0

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps == SAMPLED_AT:
            counts.append(sum(type(o) is TokenEvent for o in gc.get_objects()))
        return await decode(*args, **kwargs)

    shard.decode = counting
    return counts


@pytest.mark.parametrize("path", ["/generate_stream", "/v1/completions"])
async def test_a_stream_keeps_no_token_events(make_app: AppFactory, path: str) -> None:
    client, shard, _ = await make_app(ids_script([100, 101, 102, 103]))
    counts = _count_events_at_step(shard)
    if path == "/generate_stream":
        body: dict[str, Any] = {"inputs": "Hello", "parameters": {"max_new_tokens": TOKENS}}
    else:
        body = {"model": "scripted/model", "prompt": "Hello", "max_tokens": TOKENS,
                "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    data = [d for d in sse_data(response.text) if d != "[DONE]"]
    if path == "/generate_stream":
        assert len(data) == TOKENS
        assert json.loads(data[-1])["details"]["generated_tokens"] == TOKENS
    else:
        assert json.loads(data[-1])["usage"]["completion_tokens"] == TOKENS
    # by step SAMPLED_AT the stream has carried ~SAMPLED_AT events; a handler that kept
    # them would leave that many alive
    assert len(counts) == 1 and counts[0] < 8, counts
