"""The HTTP app over the real engine and tokenizer with a scripted shard group."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import httpx
import pytest

from router.api.app import ServerState, create_app
from router.config import SchedulerConfig, ValidationLimits
from router.engine.client import EngineClient
from router.engine.loop import Engine
from router.engine.server import ApiConnection, budgets_of
from router.tokenizer import Tokenizer
from router.validation import Validator
from tests.unit.api.scripted import Script, ScriptedShardClient

AppFactory = Callable[..., Awaitable[tuple[httpx.AsyncClient, ScriptedShardClient, Engine]]]


def text_script(tokenizer: Tokenizer, text: str) -> Script:
    """A script emitting the tokens of ``text`` for every prompt, then EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    return lambda _prompt: [*ids, eos]


def ids_script(ids: Sequence[int]) -> Script:
    """A script emitting ``ids`` (cycling) for every prompt."""
    return lambda _prompt: list(ids)


def scripted_state(
    tokenizer: Tokenizer, script: Script, limits: ValidationLimits | None = None,
    max_request_bytes: int = 1 << 20, **budgets: int,
) -> tuple[ServerState, ScriptedShardClient]:
    """The server state over a scripted shard group (engine not started)."""
    shard = ScriptedShardClient(script)
    config = SchedulerConfig(**{"max_input_tokens": 64, "max_total_tokens": 256,
                                "max_batch_prefill_tokens": 256, **budgets})
    engine = Engine(shard, tokenizer, config, shard.num_blocks,  # type: ignore[arg-type]
                    shard.block_size)
    validator = Validator(tokenizer, engine.scheduler, limits or ValidationLimits(),
                          max_request_bytes=max_request_bytes)
    state = ServerState(engine=engine, validator=validator, model_id="scripted/model",
                        dtype="float32", device_type="cpu", num_shard=1,
                        attention_backend="torch", version="test",
                        max_request_bytes=max_request_bytes)
    return state, shard


async def engine_client_of(engine: Engine) -> tuple[EngineClient, list[asyncio.Future[None]]]:
    """An API process's proxy of ``engine``, over a socket pair in this process (the same
    messages as between two processes), and the two tasks serving it."""
    ours, theirs = socket.socketpair()
    engine_reader, engine_writer = await asyncio.open_unix_connection(sock=ours)
    api_reader, api_writer = await asyncio.open_unix_connection(sock=theirs)
    connection = ApiConnection(engine, engine_reader, engine_writer, "API process (test)")
    client = EngineClient(api_reader, api_writer, engine.tokenizer, budgets_of(engine))
    return client, [asyncio.ensure_future(connection.serve()), asyncio.ensure_future(client.run())]


@pytest.fixture(params=["in_process", "api_process"])
async def make_app(
    tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> AsyncIterator[AppFactory]:
    """Factory: ``await make_app(script, **scheduler_budgets)`` → (client, shard, engine).

    Every test using it runs twice: the app over the engine in its process, and over an
    :class:`EngineClient` as in an API process (``--api-server-count``)."""
    engines: list[Engine] = []
    clients: list[httpx.AsyncClient] = []
    serving: list[asyncio.Future[None]] = []

    async def factory(
        script: Script, limits: ValidationLimits | None = None, max_request_bytes: int = 1 << 20,
        **budgets: int,
    ) -> tuple[httpx.AsyncClient, ScriptedShardClient, Engine]:
        state, shard = scripted_state(tokenizer, script, limits, max_request_bytes, **budgets)
        engine = state.engine
        assert isinstance(engine, Engine)
        engine.start()
        engines.append(engine)
        if request.param == "api_process":
            proxy, tasks = await engine_client_of(engine)
            serving.extend(tasks)
            state = dataclasses.replace(
                state, engine=proxy,
                validator=dataclasses.replace(state.validator, scheduler=proxy.budgets))
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)
        clients.append(client)
        return client, shard, engine

    yield factory
    for client in clients:
        await client.aclose()
    for engine in engines:
        await engine.stop()
    for task in serving:
        task.cancel()
    await asyncio.gather(*serving, return_exceptions=True)


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    return [line[len("data:"):].strip() for line in body.splitlines() if line.startswith("data:")]
