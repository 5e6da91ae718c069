"""The answer-burst benchmark drives the real server (one process, and an API process
beside the engine) and its bare-ASGI floor with both of its clients: every request of
the burst gets its whole answer, and all of them decode together."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.steps import answer_burst


@pytest.mark.parametrize("api_servers", [0, 1])
def test_every_answer_of_the_burst_arrives(api_servers: int) -> None:
    # run() asserts each answer's completion_tokens and one finish per request
    row = asyncio.run(answer_burst.run(answer_burst.DEFAULT_TOKENIZER, 6, 16, 4, 0.005,
                                       api_servers, "aiohttp"))
    assert row.api_servers == api_servers and row.to_first_ms <= row.to_last_ms


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
def test_the_floor_answers_every_request(client: str) -> None:
    row = asyncio.run(answer_burst.run_floor(answer_burst.DEFAULT_TOKENIZER, 5, 16, 8, client))
    assert row.client == client and row.to_first_ms <= row.to_last_ms
