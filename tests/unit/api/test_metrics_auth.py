"""``--api-key`` leaves ``/health`` and ``/metrics`` open to probes and scrapers (as vLLM
and TGI do); ``--metrics-require-api-key on`` closes ``/metrics`` too. The real app and
middleware over a scripted engine."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from router.api.app import create_app
from router.cli import build_parser, config_from_args
from router.config import ServerConfig
from router.tokenizer import Tokenizer
from shard.config import ShardConfig
from tests.unit.api.conftest import scripted_state, text_script

KEY = "k3y"
Client = Callable[[bool], Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def client(tokenizer: Tokenizer) -> AsyncIterator[Client]:
    """``await client(metrics_require_api_key)``: an HTTP client of the app with
    ``--api-key``."""
    clients: list[httpx.AsyncClient] = []

    async def make(metrics_require_api_key: bool) -> httpx.AsyncClient:
        state, _ = scripted_state(tokenizer, text_script(tokenizer, " fine"))
        state = dataclasses.replace(state, api_key=KEY,
                                    metrics_require_api_key=metrics_require_api_key)
        transport = httpx.ASGITransport(app=create_app(state))
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://test"))
        return clients[-1]

    yield make
    for made in clients:
        await made.aclose()


async def test_metrics_are_open_by_default(client: Client) -> None:
    http = await client(False)
    assert (await http.get("/metrics")).status_code == 200
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/info")).status_code == 401


async def test_metrics_need_the_key_when_asked(client: Client) -> None:
    http = await client(True)
    refused = await http.get("/metrics")
    assert refused.status_code == 401
    assert refused.json()["error_type"] == "authentication"
    allowed = await http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200
    assert "shardserve_requests_total" in allowed.text
    assert (await http.get("/health")).status_code == 200  # probes stay open


def test_the_flag_is_read_from_the_command_line(default_model_dir: object) -> None:
    parser = build_parser(environ={})
    launch = ["launch", "--model", str(default_model_dir), "--api-key", KEY]
    assert not config_from_args(parser.parse_args(launch)).metrics_require_api_key
    args = parser.parse_args([*launch, "--metrics-require-api-key", "on"])
    assert config_from_args(args).metrics_require_api_key


def test_the_flag_needs_a_key() -> None:
    with pytest.raises(ValueError, match="--metrics-require-api-key on needs --api-key"):
        ServerConfig(shard=ShardConfig(model_path="m", model_id="m"),
                     metrics_require_api_key=True)
