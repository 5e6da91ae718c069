"""CASES "Stop strings and streaming text" (S1-S6) through the HTTP API, with a scripted
shard forcing the tokens and the real tokenizer detokenizing them."""

from __future__ import annotations

import json

import grpc

from router.grpc_api.server import start_grpc_server
from router.pb import generate_pb2, generate_pb2_grpc
from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, ids_script, scripted_state, sse_data, text_script

PA, RIS = 13947, 4593  # " Pa", "ris"


async def generate(client, inputs: str = "Where?", **parameters: object):  # type: ignore[no-untyped-def]
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 12, "details": True, **parameters}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client, inputs: str = "Where?", **parameters: object) -> list[dict]:  # type: ignore[no-untyped-def]
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 12, **parameters}}
    response = await client.post("/generate_stream", json=body)
    assert response.status_code == 200, response.text
    return [json.loads(data) for data in sse_data(response.text)]


async def test_stop_spanning_two_tokens_s1(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode(" The capital is", add_special_tokens=False), PA, RIS, 30]
    client, _, _ = await make_app(ids_script(ids))
    body = await generate(client, stop=["Pari"])
    assert body["generated_text"] == " The capital is Pari"  # TGI: ends with the stop
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == len(ids) - 1


async def test_long_stop_never_streamed_in_pieces_s2(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    text = " one two three four five six seven"
    client, _, _ = await make_app(text_script(tokenizer, text))
    stop = " four five six"
    events = await stream(client, stop=[stop])
    pieces = [event["token"]["text"] for event in events]
    for piece in pieces[:-1]:
        assert not any(word in piece for word in ("four", "five", "six")), pieces
    joined = "".join(pieces)
    plain = await generate(client, stop=[stop])
    assert joined == plain["generated_text"] == events[-1]["generated_text"]
    assert joined == " one two three four five six"
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"


async def test_single_token_stop_s3(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " Hello world\nmore text"))
    body = await generate(client, stop=["\n"])
    assert body["generated_text"] == " Hello world\n"
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == 3


async def test_openai_chat_stop_not_in_content_s4(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    client, _, _ = await make_app(text_script(tokenizer, " The answer is Paris. Done."))
    body = {"messages": [{"role": "user", "content": "Capital?"}], "max_tokens": 12,
            "stop": ["Paris"], "temperature": 0}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == " The answer is "
    assert choice["finish_reason"] == "stop"
    streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(d) for d in sse_data(streamed.text)[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == " The answer is "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    completion = await client.post("/v1/completions", json={"prompt": "Capital?", "stop": "Paris",
                                                            "max_tokens": 12, "temperature": 0})
    assert completion.json()["choices"][0]["text"] == " The answer is "


async def test_multibyte_characters_never_split_s5(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    text = " Smile 😀 and 日本語, café, naïve 🎉!"
    client, _, _ = await make_app(text_script(tokenizer, text))
    events = await stream(client, max_new_tokens=40)
    pieces = [event["token"]["text"] for event in events]
    assert all("\ufffd" not in piece for piece in pieces), pieces
    assert "".join(pieces) == text == events[-1]["generated_text"]


async def test_leading_spaces_kept_token_by_token_s6(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    text = " The  quick brown   fox jumps over the lazy dog."
    client, _, _ = await make_app(text_script(tokenizer, text))
    events = await stream(client, max_new_tokens=40)
    assert "".join(event["token"]["text"] for event in events) == text
    chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "stream": True}
    response = await client.post("/v1/chat/completions", json=chat)
    chunks = [json.loads(d) for d in sse_data(response.text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text


async def test_held_back_text_stays_with_its_token(
    make_app: AppFactory, tokenizer: Tokenizer
) -> None:
    """A stop string that could begin inside " Pa" holds text back until "." rules it out:
    the stream releases it late (S2), but a whole answer's tokens keep their own text and
    OpenAI's text_offset counts each token's own text, streamed or not."""
    ids = [*tokenizer.encode(" It is", add_special_tokens=False), PA, RIS, 30]
    own = [tokenizer.decode([i]) for i in ids]
    client, _, _ = await make_app(ids_script(ids))
    body = await generate(client, stop=["Paris!"], max_new_tokens=len(ids))
    assert [t["text"] for t in body["details"]["tokens"]] == own
    assert body["generated_text"] == "".join(own) == " It is Paris."
    pieces = [e["token"]["text"] for e in await stream(client, stop=["Paris!"],
                                                       max_new_tokens=len(ids))]
    assert pieces[-3:] == [" ", "", "Paris."]  # held back, then released at once
    assert "".join(pieces) == body["generated_text"]

    expected = [sum(len(t) for t in own[:i]) for i in range(len(own))]
    request = {"prompt": "Where?", "max_tokens": len(ids), "logprobs": 1, "stop": ["Paris!"]}
    whole = await client.post("/v1/completions", json=request)
    logprobs = whole.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == own
    assert logprobs["text_offset"] == expected
    streamed = await client.post("/v1/completions", json={**request, "stream": True})
    chunks = [json.loads(d) for d in sse_data(streamed.text)[:-1]]
    offsets = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get(
        "text_offset", [])]
    assert offsets == expected
    assert "".join(c["choices"][0]["text"] for c in chunks) == " It is Paris."


async def test_grpc_tokens_keep_their_own_text_and_streams_hold_back(
    tokenizer: Tokenizer,
) -> None:
    """The public gRPC API as the HTTP one: a whole answer's tokens carry their own text,
    a stream's pieces hold back what may begin the stop string (S2)."""
    ids = [*tokenizer.encode(" It is", add_special_tokens=False), PA, RIS, 30]
    own = [tokenizer.decode([i]) for i in ids]
    state, _ = scripted_state(tokenizer, ids_script(ids))
    state.engine.start()
    server, port = await start_grpc_server(state, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            params = generate_pb2.Parameters(max_new_tokens=len(ids), stop=["Paris!"])
            request = generate_pb2.GenerateRequest(inputs="Where?", parameters=params)
            whole = await stub.Generate(request, timeout=30)
            assert [t.text for t in whole.sequence.tokens] == own
            assert whole.sequence.generated_text == "".join(own)
            pieces = [m.token.text async for m in stub.GenerateStream(request, timeout=30)]
            assert pieces[-3:] == [" ", "", "Paris."]
            assert "".join(pieces) == "".join(own)
    finally:
        await server.stop(grace=None)
        await state.engine.stop()
