"""Large inputs on every entry point: the character pre-check and the byte limit bound
them all (TGI, OpenAI, ``/tokenize``, public gRPC), and tokenizing them does not stop
the event loop that drives generation."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import pytest

from router.grpc_api.server import start_grpc_server
from router.pb import generate_pb2, generate_pb2_grpc
from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, ids_script, scripted_state, text_script

# Budgets large enough that a prompt of ~1 MiB passes the character pre-check.
LARGE_BUDGETS = {"max_input_tokens": 16_000, "max_total_tokens": 16_384,
                 "max_batch_prefill_tokens": 16_384}


def too_many_chars(tokenizer: Tokenizer, max_input_tokens: int = 64) -> str:
    """Text one character longer than ``max_input_tokens`` tokens can hold."""
    return "a" * (max_input_tokens * tokenizer.max_token_chars + 1)


async def test_tokenize_applies_the_character_precheck(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    response = await client.post("/tokenize", json={"inputs": too_many_chars(tokenizer)})
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("inputs: ")
    assert "characters" in response.json()["error"]
    ok = await client.post("/tokenize", json={"inputs": "Hello world"})
    assert [t["text"] for t in ok.json()] == ["Hello", " world"]
    assert [(t["start"], t["stop"]) for t in ok.json()] == [(0, 5), (5, 11)]


async def test_chat_messages_apply_the_character_precheck(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"))
    body = {"messages": [{"role": "user", "content": too_many_chars(tokenizer)}],
            "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "characters" in error["message"]


async def test_truncate_is_bounded_by_the_request_byte_limit(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " fine"), max_request_bytes=50_000)
    # Past the character pre-check of 64 tokens, kept by truncate, within the byte limit.
    text = "word " * 9_000
    body = {"inputs": text, "parameters": {"truncate": 8, "max_new_tokens": 2}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    body = {"inputs": "word " * 11_000, "parameters": {"truncate": 8, "max_new_tokens": 2}}
    assert (await client.post("/generate", json=body)).status_code == 413


@pytest.fixture
async def grpc_channel(tokenizer: Tokenizer) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to the public gRPC API over a scripted shard group, with a 64 KiB
    request limit."""
    state, _ = scripted_state(tokenizer, text_script(tokenizer, " fine"),
                              max_request_bytes=64 * 1024)
    state.engine.start()
    server, port = await start_grpc_server(state, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(grace=None)
    await state.engine.stop()


@pytest.fixture
def grpc_stub(grpc_channel: grpc.aio.Channel) -> generate_pb2_grpc.TextGenerationStub:
    return generate_pb2_grpc.TextGenerationStub(grpc_channel)


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value


async def test_grpc_messages_are_capped_by_max_request_bytes(
    grpc_stub: generate_pb2_grpc.TextGenerationStub,
) -> None:
    params = generate_pb2.Parameters(max_new_tokens=2, truncate=8)
    request = generate_pb2.GenerateRequest(inputs="word " * 14_000, parameters=params)
    error = await rpc_error(grpc_stub.Generate(request, timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    # Under the cap: served (truncate keeps the last 8 tokens).
    request = generate_pb2.GenerateRequest(inputs="word " * 12_000, parameters=params)
    response = await grpc_stub.Generate(request, timeout=30)
    assert response.sequence.generated_tokens == 2


async def test_grpc_applies_the_character_precheck(
    grpc_stub: generate_pb2_grpc.TextGenerationStub, tokenizer: Tokenizer
) -> None:
    text = too_many_chars(tokenizer)
    for call in (
        grpc_stub.Generate(generate_pb2.GenerateRequest(inputs=text), timeout=30),
        grpc_stub.Tokenize(generate_pb2.TokenizeRequest(inputs=text), timeout=30),
    ):
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("inputs: ") and "characters" in str(
            error.details()
        )
    stream = grpc_stub.GenerateStream(generate_pb2.GenerateRequest(inputs=text), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as stream_error:
        async for _ in stream:
            pass
    assert stream_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # not protobuf
    generate_pb2.GenerateRequest(inputs="hi").SerializeToString()[:-1],  # truncated
    b"\x0a\x02\xc3\x28",  # field 1 (inputs) holding bytes that are not UTF-8
])
async def test_grpc_request_that_does_not_parse_is_invalid_argument(
    grpc_channel: grpc.aio.Channel, grpc_stub: generate_pb2_grpc.TextGenerationStub,
    payload: bytes,
) -> None:
    service = "/shardserve.generate.v1.TextGeneration/"
    unary = grpc_channel.unary_unary(service + "Generate")
    error = await rpc_error(unary(payload, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert (error.details() or "").startswith("request: not a valid protobuf message")
    stream = grpc_channel.unary_stream(service + "GenerateStream")(payload, timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as stream_error:
        async for _ in stream:
            pass
    assert stream_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # valid requests go on as before, streamed or not
    request = generate_pb2.GenerateRequest(
        inputs="hi", parameters=generate_pb2.Parameters(max_new_tokens=2))
    assert (await grpc_stub.Generate(request, timeout=30)).sequence.generated_tokens == 2
    streamed = [m async for m in grpc_stub.GenerateStream(request, timeout=30)]
    assert len(streamed) == 2


LONG_TEXT = "hello world, this is some text. " * 30_000  # 960,000 characters

LARGE_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/generate", {"inputs": LONG_TEXT, "parameters": {"truncate": 16, "max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": LONG_TEXT, "truncate": 16, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}],
                              "truncate": 16, "max_tokens": 2}),
    ("/tokenize", {"inputs": LONG_TEXT[:400_000]}),
]


@pytest.mark.parametrize(("path", "body"), LARGE_REQUESTS, ids=[p for p, _ in LARGE_REQUESTS])
async def test_a_large_input_does_not_stop_the_event_loop(
    make_app: AppFactory, path: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = await make_app(ids_script([300, 301]), **LARGE_BUDGETS)
    text = body.get("inputs") or body.get("prompt") or body["messages"][0]["content"]
    threads: list[tuple[int, int]] = []  # (thread, characters) of every tokenization
    encoding = Tokenizer.encoding

    def recorded(self: Tokenizer, text: str, add_special_tokens: bool = True) -> Any:
        threads.append((threading.get_ident(), len(text)))
        return encoding(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encoding", recorded)
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    # The event loop (which also serves every stream) never runs the tokenizer itself:
    # the large text is tokenized in a worker thread (the tokenizer releases the GIL).
    large = [thread for thread, chars in threads if chars >= len(text)]
    assert large, threads
    assert threading.get_ident() not in large
