"""Real clients, unmodified, against the default model on the session server: the
``openai`` package, Hugging Face's ``text-generation`` client and a gRPC stub built from
proto/generate.proto (plus reflection and the standard health service)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from openai import OpenAI
from text_generation import Client

from router.pb import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def openai_client(ray_server: str) -> OpenAI:
    return OpenAI(base_url=f"{ray_server}/v1", api_key="unused", timeout=300)


def test_openai_completions(openai_client: OpenAI, ray_server: str) -> None:
    model = openai_client.models.list().data[0].id
    assert model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    completion = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                                  temperature=0, logprobs=2)
    choice = completion.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 8
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    stream = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                              temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == choice.text


def test_openai_chat(openai_client: OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    chat = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0, n=2, seed=1,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    content = chat.choices[0].message.content
    assert content and "Paris" in content
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    stream = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens // 2  # type: ignore[union-attr]


def test_text_generation_client(ray_server: str) -> None:
    client = Client(ray_server, timeout=300)
    response = client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True,
                               top_n_tokens=2)
    assert response.details.generated_tokens == 10
    assert response.details.finish_reason.value == "length"
    assert len(response.details.prefill) == 5 and response.details.prefill[0].logprob is None
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=10))
    assert "".join(r.token.text for r in streamed) == response.generated_text
    assert streamed[-1].generated_text == response.generated_text
    assert streamed[-1].details is not None and streamed[-1].details.generated_tokens == 10
    sampled = client.generate(PROMPT, max_new_tokens=5, do_sample=True, best_of=2)
    assert sampled.details.best_of_sequences is not None
    assert len(sampled.details.best_of_sequences) == 1


def test_grpc_generate_stream_reflection_and_health(grpc_address: str, ray_server: str) -> None:
    with grpc.insecure_channel(grpc_address) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            inputs=PROMPT, parameters=generate_pb2.Parameters(max_new_tokens=10)
        )
        response = stub.Generate(request, timeout=300)
        assert response.sequence.generated_tokens == 10
        assert response.sequence.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        messages = list(stub.GenerateStream(request, timeout=300))
        assert len(messages) == 10
        assert "".join(m.token.text for m in messages) == response.sequence.generated_text
        assert messages[-1].generated_text == response.sequence.generated_text
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(generate_pb2.GenerateRequest(
                inputs=PROMPT, parameters=generate_pb2.Parameters(top_p=1.5)), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in (error.value.details() or "")
        assert stub.ModelInfo(generate_pb2.ModelInfoRequest()).model_id.endswith("Instruct")

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
        )
        names = {s.name for answer in answers for s in answer.list_services_response.service}
        assert "shardserve.generate.v1.TextGeneration" in names
        assert "grpc.health.v1.Health" in names

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "shardserve.generate.v1.TextGeneration"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
