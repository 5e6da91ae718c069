"""Failures between an API process and the engine (``--api-server-count``), over a real
socket pair: every request ends with an error its client can read, the log says why,
and a failure stays as small as it can (one bad message or event fails one request)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from loguru import logger

from router.api.app import create_app
from router.api.generation import GenerationFailed, run_all
from router.config import SchedulerConfig
from router.engine.client import ENGINE_GONE, EngineClient
from router.engine.loop import Engine
from router.engine.server import ApiConnection, budgets_of
from router.request import (
    ErrorEvent,
    GenerationRequest,
    HeldAnswer,
    SamplingParams,
    StoppingParams,
)
from router.tokenizer import Tokenizer
from tests.unit.api.conftest import scripted_state
from tests.unit.api.scripted import ScriptedShardClient

BUDGETS = SchedulerConfig(max_input_tokens=64, max_total_tokens=256,
                          max_batch_prefill_tokens=256)
NAME = "API process (test)"
# What cut_frame leaves: a header announcing 1000 bytes, then only the first few.
CUT_BODY = b"\x80\x05 not all of it"
CUT = f"the socket closed in the middle of a message ({4 + len(CUT_BODY)} of 1004 bytes)"


@dataclass
class Wire:
    """An engine and its proxy over a socket pair, each end's streams kept."""

    engine: Engine
    connection: ApiConnection
    client: EngineClient
    engine_writer: asyncio.StreamWriter
    api_writer: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]]


async def wire_up(engine: Engine) -> Wire:
    ours, theirs = socket.socketpair()
    engine_reader, engine_writer = await asyncio.open_unix_connection(sock=ours)
    api_reader, api_writer = await asyncio.open_unix_connection(sock=theirs)
    connection = ApiConnection(engine, engine_reader, engine_writer, NAME)
    client = EngineClient(api_reader, api_writer, engine.tokenizer, budgets_of(engine))
    tasks = [asyncio.create_task(connection.serve()), asyncio.create_task(client.run())]
    return Wire(engine, connection, client, engine_writer, api_writer, tasks)


def scripted_engine(tokenizer: Tokenizer) -> Engine:
    """An engine (not started) whose requests generate ``100 + the prompt's last id``."""
    shard = ScriptedShardClient(lambda prompt: [100 + prompt[-1]])
    return Engine(shard, tokenizer, BUDGETS, shard.num_blocks,  # type: ignore[arg-type]
                  shard.block_size)


@pytest.fixture
async def wire(tokenizer: Tokenizer) -> AsyncIterator[Wire]:
    engine = scripted_engine(tokenizer)
    engine.start()
    wired = await wire_up(engine)
    yield wired
    await engine.stop()
    for task in wired.tasks:
        task.cancel()
    await asyncio.gather(*wired.tasks, return_exceptions=True)


@pytest.fixture
def log() -> Iterator[list[str]]:
    """The messages logged at WARNING and above while the test runs."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]),
                      level="WARNING", format="{message}")
    yield lines
    logger.remove(sink)


def whole(prompt: tuple[int, ...], tokens: int = 8) -> GenerationRequest:
    """A request that does not stream: its answer crosses whole, at its end."""
    return GenerationRequest(prompt, SamplingParams(),
                             StoppingParams(max_new_tokens=tokens, ignore_eos=True),
                             stream=False, token_texts=False)


def cut_frame(writer: asyncio.StreamWriter) -> None:
    """Write the start of a message and close the socket: what a process that dies in
    the middle of a write leaves."""
    writer.write(struct.pack("!I", 1000) + CUT_BODY)
    writer.close()


async def queued(engine: Engine, count: int) -> None:
    """Wait until ``engine`` holds ``count`` requests (its loop is not started: they
    stay queued until a test ends them)."""
    async with asyncio.timeout(10.0):
        while engine.scheduler.num_requests != count:
            await asyncio.sleep(0.01)


async def test_a_message_that_fails_in_the_engine_fails_its_request_alone(
    wire: Wire, log: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    submit = Engine.submit

    def failing(engine: Engine, request: GenerationRequest, **kwargs: Any) -> Any:
        if request.input_ids == (7, 7, 7):
            raise RuntimeError("boom")
        return submit(engine, request, **kwargs)

    monkeypatch.setattr(Engine, "submit", failing)
    good, bad = whole((5, 6)), whole((7, 7, 7))
    async with asyncio.timeout(10.0):
        results = await asyncio.gather(run_all(wire.client, [good]), run_all(wire.client, [bad]),
                                       run_all(wire.client, [good]), return_exceptions=True)
    first, failed, last = results
    assert isinstance(failed, GenerationFailed)
    assert str(failed) == "internal error: RuntimeError: boom"
    for result in (first, last):  # the others are served, over the same connection
        assert not isinstance(result, BaseException), result
        assert result[0].num_generated == 8
    assert not wire.client.gone
    assert f"a 'submit' message of {NAME} failed" in log


async def test_an_answer_that_does_not_pickle_fails_its_request_alone(
    wire: Wire, log: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    forward_answer = ApiConnection.forward_answer

    def spoiled(connection: ApiConnection, rid: int, held: HeldAnswer) -> None:
        if held.ids[0] == 100 + 9:  # the answer to prompt (9,)
            held.texts[0] = threading.Lock()  # type: ignore[assignment]
        forward_answer(connection, rid, held)

    monkeypatch.setattr(ApiConnection, "forward_answer", spoiled)
    # both finish in the same step: their answers leave in one message
    async with asyncio.timeout(10.0):
        fine, failed = await asyncio.gather(run_all(wire.client, [whole((8,))]),
                                            run_all(wire.client, [whole((9,))]),
                                            return_exceptions=True)
    assert not isinstance(fine, BaseException), fine
    assert fine[0].num_generated == 8
    assert isinstance(failed, GenerationFailed)
    assert "could not be sent to the API process" in str(failed)
    assert f"events for {NAME} do not pickle" in log


async def test_a_failed_engine_connection_gives_its_clients_a_readable_error(
    tokenizer: Tokenizer, log: list[str],
) -> None:
    state, _ = scripted_state(tokenizer, lambda _prompt: [100])
    engine = state.engine
    assert isinstance(engine, Engine)
    wired = await wire_up(engine)
    app = create_app(dataclasses.replace(
        state, engine=wired.client,
        validator=dataclasses.replace(state.validator, scheduler=wired.client.budgets)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=30) as http:
            body = {"model": "scripted/model", "prompt": "Hello", "max_tokens": 200,
                    "ignore_eos": True}
            answer = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await queued(engine, 1)
            cut_frame(wired.engine_writer)  # the engine process dies mid-write
            response = await asyncio.wait_for(answer, 10.0)
    finally:
        await engine.stop()
        await asyncio.gather(*wired.tasks, return_exceptions=True)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == ENGINE_GONE
    assert f"the connection to the engine process failed: {CUT}" in log
    assert "the engine process is gone: failing 1 open request(s)" in log


async def test_an_api_process_that_goes_is_logged_with_the_requests_it_cancels(
    tokenizer: Tokenizer, log: list[str],
) -> None:
    wire = await wire_up(scripted_engine(tokenizer))
    streams = [wire.client.generate(whole((5,))) for _ in range(3)]
    pending = [asyncio.ensure_future(anext(stream)) for stream in streams]
    await queued(wire.engine, 3)
    cut_frame(wire.api_writer)  # the API process dies mid-write
    async with asyncio.timeout(10.0):
        await asyncio.gather(*wire.tasks, return_exceptions=True)
    assert wire.engine.scheduler.num_requests == 0  # cancelled there
    assert f"the connection to {NAME} failed: {CUT}" in log
    assert f"{NAME} is gone: cancelling its 3 open request(s)" in log
    for task in pending:  # and here, each stream ends with the error
        event = await task
        assert isinstance(event, ErrorEvent) and event.message == ENGINE_GONE
