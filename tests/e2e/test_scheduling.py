"""Scheduling through the real HTTP server on a tiny model: cancellation, many short
requests, and KV limits (CASES M1-M3)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from router.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import launch, stop
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

TINY_ARGS = ["--executor", "local", "--max-total-tokens", "512", "--max-concurrent-requests",
             "256", "--kv-cache-bytes", str(4 * 1024 * 1024)]


@pytest.fixture(scope="module")
def tiny_grpc_port() -> int:
    """The public gRPC port of :func:`tiny_server`, picked just before it starts."""
    return unused_port()


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                tiny_grpc_port: int) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("tiny") / "server.log"
    args = ["--model", str(tiny_model_dir), "--grpc-port", str(tiny_grpc_port), *TINY_ARGS]
    base_url, process = launch(args, log_path)
    yield base_url
    stop(process)


def cancelled_count(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    for line in metrics.splitlines():
        if line.startswith('shardserve_requests_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def kv_blocks_free(base_url: str) -> int:
    return int(httpx.get(f"{base_url}/info", timeout=30).json()["kv_blocks_free"])


def wait_for_free_blocks(base_url: str, expected: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    free = kv_blocks_free(base_url)
    while free != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        free = kv_blocks_free(base_url)
    return free


async def cancelled_stream(client: httpx.AsyncClient, base_url: str, index: int) -> int:
    """Open a long stream, read two tokens, then disconnect."""
    body = {"inputs": f"Story number {index}:",
            "parameters": {"max_new_tokens": 300, "ignore_eos": True}}
    received = 0
    async with client.stream("POST", f"{base_url}/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                received += 1
                if received == 2:
                    break
    return received


def test_500_cancelled_streams_free_every_block_m1(tiny_server: str) -> None:
    baseline = kv_blocks_free(tiny_server)

    async def rounds() -> list[int]:
        received: list[int] = []
        async with httpx.AsyncClient(timeout=120) as client:
            for round_index in range(10):
                received += await asyncio.gather(
                    *(cancelled_stream(client, tiny_server, 50 * round_index + i)
                      for i in range(50))
                )
        return received

    assert asyncio.run(rounds()) == [2] * 500
    assert wait_for_free_blocks(tiny_server, baseline) == baseline
    assert cancelled_count(tiny_server) == 500


def test_cancelled_grpc_streams_free_their_blocks(tiny_server: str, tiny_grpc_port: int) -> None:
    baseline = kv_blocks_free(tiny_server)
    request = generate_pb2.GenerateRequest(
        inputs="A very long story:",
        parameters=generate_pb2.Parameters(max_new_tokens=300, ignore_eos=True),
    )
    with grpc.insecure_channel(f"127.0.0.1:{tiny_grpc_port}") as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        for _ in range(5):
            call = stub.GenerateStream(request, timeout=60)
            assert [next(call).token.text is not None for _ in range(3)] == [True] * 3
            assert kv_blocks_free(tiny_server) < baseline  # the stream holds blocks
            call.cancel()
    assert wait_for_free_blocks(tiny_server, baseline) == baseline


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"inputs": "Once upon a time",
                       "parameters": {"max_new_tokens": 480, "ignore_eos": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                  "max_tokens": 400, "ignore_eos": True}),
    ],
)
def test_client_gone_cancels_a_non_streaming_request(
    tiny_server: str, path: str, body: dict[str, object]
) -> None:
    baseline = kv_blocks_free(tiny_server)
    cancelled_before = cancelled_count(tiny_server)
    # about a second of generation for this model on a CPU; the client leaves after 0.3 s
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{tiny_server}{path}", json=body, timeout=0.3)
    # Cancelled within a poll and a step, not finished: counted as cancelled.
    assert wait_for_free_blocks(tiny_server, baseline, timeout_s=3.0) == baseline
    assert cancelled_count(tiny_server) == cancelled_before + 1


def test_2000_short_requests_leave_no_leak_m2(tiny_server: str) -> None:
    baseline = kv_blocks_free(tiny_server)

    async def run_all() -> list[int]:
        semaphore = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(index: int) -> int:
                body = {"inputs": f"Request {index}", "parameters": {"max_new_tokens": 2}}
                async with semaphore:
                    response = await client.post(f"{tiny_server}/generate", json=body)
                return response.status_code

            return list(await asyncio.gather(*(one(i) for i in range(2000))))

    assert asyncio.run(run_all()) == [200] * 2000
    assert wait_for_free_blocks(tiny_server, baseline) == baseline


@pytest.fixture(scope="module")
def small_kv_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The tiny model with 8 KV blocks of 16 tokens (512 B per token: 64 KiB)."""
    log_path = tmp_path_factory.mktemp("small-kv") / "server.log"
    args = ["--model", str(tiny_model_dir), "--executor", "local", "--kv-cache-bytes",
            str(64 * 1024), "--max-total-tokens", "128", "--max-input-tokens", "100",
            "--max-batch-prefill-tokens", "128"]
    base_url, process = launch(args, log_path)
    yield base_url
    stop(process)


def test_prompt_that_can_never_fit_is_rejected_m3(small_kv_server: str) -> None:
    info = httpx.get(f"{small_kv_server}/info", timeout=30).json()
    assert info["kv_blocks_total"] == 8
    body = {"inputs": "word " * 90, "parameters": {"max_new_tokens": 60}}
    response = httpx.post(f"{small_kv_server}/generate", json=body, timeout=30)
    assert response.status_code == 422
    assert "128" in response.json()["error"]
    body = {"inputs": "word " * 150, "parameters": {"max_new_tokens": 5}}
    response = httpx.post(f"{small_kv_server}/generate", json=body, timeout=30)
    assert response.status_code == 422 and "max_input_tokens=100" in response.json()["error"]


def test_two_prompts_that_fit_one_at_a_time_are_both_served_m3(small_kv_server: str) -> None:
    # 48 + 60 = 108 tokens = 7 blocks each: only one fits in the 8 blocks at a time.
    bodies = [
        {"inputs": ("alpha " if i == 0 else "beta ") * 48,
         "parameters": {"max_new_tokens": 60, "ignore_eos": True, "details": True}}
        for i in range(2)
    ]
    alone = [httpx.post(f"{small_kv_server}/generate", json=b, timeout=120).json() for b in bodies]

    async def together() -> list[dict[str, object]]:
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.wait_for(
                asyncio.gather(*(client.post(f"{small_kv_server}/generate", json=b)
                                 for b in bodies)),
                timeout=120,
            )
        assert [r.status_code for r in responses] == [200, 200]
        return [json.loads(r.text) for r in responses]

    both = asyncio.run(together())
    for served, reference in zip(both, alone, strict=True):
        assert served["generated_text"] == reference["generated_text"]
        tokens = served["details"]["tokens"]  # type: ignore[index]
        reference_tokens = reference["details"]["tokens"]
        assert [t["id"] for t in tokens] == [t["id"] for t in reference_tokens]
        # Logprobs may differ in the last bits between batch compositions.
        assert [t["logprob"] for t in tokens] == pytest.approx(
            [t["logprob"] for t in reference_tokens], abs=1e-4
        )
    assert kv_blocks_free(small_kv_server) == 8


def test_warmup_out_of_memory_names_the_flag(tiny_model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "launch", "--model", str(tiny_model_dir),
         "--executor", "local", "--kv-cache-bytes", "4096", "--port", "0", "--grpc-port", "0"],
        capture_output=True, text=True, timeout=300,  # a loaded 2-core machine starts slowly
    )
    assert result.returncode == 1
    assert "--kv-cache-bytes" in result.stderr
