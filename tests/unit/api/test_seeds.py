"""Seeds are uint64 on every API (the public gRPC ``Parameters.seed`` is ``uint64``, and
so is the shards' ``SamplingParameters.seed``): a seed above 2^63 - 1 is accepted,
reported back and reaches the shards unchanged, the same way from HTTP and from gRPC;
choice i of n uses ``seed + i`` modulo 2^64."""

from __future__ import annotations

import grpc
import pytest

from router.grpc_api.server import start_grpc_server
from router.pb import generate_pb2, generate_pb2_grpc
from router.tokenizer import Tokenizer
from tests.unit.api.conftest import AppFactory, ids_script, scripted_state

TOP = 2**64 - 1


async def test_top_seed_over_http(make_app: AppFactory, tokenizer: Tokenizer) -> None:
    client, shard, _ = await make_app(ids_script([30, 31]))
    response = await client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 2, "do_sample": True, "seed": TOP, "details": True}})
    assert response.status_code == 200, response.text
    assert response.json()["details"]["seed"] == TOP
    assert shard.prefilled[-1].sampling.seed == TOP
    # choice i uses seed + i, wrapping past 2^64 - 1
    response = await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "seed": TOP - 1, "n": 3})
    assert response.status_code == 200, response.text
    assert sorted(r.sampling.seed for r in shard.prefilled[-3:]) == [0, TOP - 1, TOP]
    for path, body in (("/generate", {"inputs": "Hi", "parameters": {"seed": TOP + 1}}),
                       ("/v1/completions", {"prompt": "Hi", "seed": TOP + 1})):
        response = await client.post(path, json=body)
        assert response.status_code in (400, 422) and "seed" in response.text, response.text


@pytest.mark.parametrize("seed", [2**63, TOP])
async def test_top_seed_over_grpc(tokenizer: Tokenizer, seed: int) -> None:
    state, shard = scripted_state(tokenizer, ids_script([30, 31]))
    state.engine.start()
    server, port = await start_grpc_server(state, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            params = generate_pb2.Parameters(max_new_tokens=2, do_sample=True, seed=seed)
            request = generate_pb2.GenerateRequest(inputs="Hi", parameters=params)
            whole = await stub.Generate(request, timeout=30)
            assert whole.sequence.seed == seed
            assert shard.prefilled[-1].sampling.seed == seed
            last = [m async for m in stub.GenerateStream(request, timeout=30)][-1]
            assert last.seed == seed
    finally:
        await server.stop(grace=None)
        await state.engine.stop()
