"""``--api-key`` (here from ``SHARDSERVE_API_KEY``): HTTP and public gRPC calls need
``Bearer <key>``; /health, /metrics and the gRPC health service stay open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.pb import generate_pb2, generate_pb2_grpc
from tests.integration.live_server import LiveServer, launch_tiny

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("auth") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, env={"SHARDSERVE_API_KEY": KEY})
    yield live
    live.stop()


def openai_client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_needs_the_key(server: LiveServer) -> None:
    client = openai_client(server, KEY)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert completion.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError) as failure:
        openai_client(server, "wrong").completions.create(model=model, prompt="Hi", max_tokens=2)
    assert failure.value.status_code == 401
    assert KEY not in failure.value.message


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"inputs": "Hi"}),
    ("GET", "/info", None),
    ("GET", "/v1/models", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
])
def test_http_routes_need_the_key(server: LiveServer, method: str, path: str,
                                  body: object) -> None:
    url = f"{server.url}{path}"
    refused = httpx.request(method, url, json=body, timeout=60)
    assert refused.status_code == 401, refused.text
    assert refused.headers["www-authenticate"] == "Bearer"
    wrong = httpx.request(method, url, json=body, timeout=60,
                          headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    allowed = httpx.request(method, url, json=body, timeout=60,
                            headers={"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200, allowed.text


def test_health_and_metrics_stay_open(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200


def test_grpc_needs_the_key_but_health_does_not(server: LiveServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            inputs="Hi", parameters=generate_pb2.Parameters(max_new_tokens=2, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as failure:
            stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.GenerateStream(request, timeout=30,
                                     metadata=[("authorization", "Bearer nope")]))
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = [("authorization", f"Bearer {KEY}")]
        assert stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30, metadata=key).model_id
        assert stub.Generate(request, timeout=60, metadata=key).sequence.generated_tokens == 2
        assert len(list(stub.GenerateStream(request, timeout=60, metadata=key))) == 2
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING
