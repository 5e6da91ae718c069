"""SIGTERM drains the public gRPC API like HTTP: open streams get --graceful-timeout to
finish, new calls are answered UNAVAILABLE meanwhile, and the server exits 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from router.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import SMALL_BUDGETS, launch, stop
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

# Long enough to outlive the 5 s after which gRPC streams used to be cut (the default
# model decodes a few dozen tokens per second on CPU).
STREAM_TOKENS = 300


def test_sigterm_gives_grpc_streams_the_graceful_timeout(
    default_model_dir: Path, tmp_path: Path
) -> None:
    port = unused_port()
    _, process = launch(["--executor", "local", "--grpc-port", str(port),
                         "--graceful-timeout", "120", *SMALL_BUDGETS], tmp_path / "server.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            request = generate_pb2.GenerateRequest(
                inputs="Write a long story about a dragon.",
                parameters=generate_pb2.Parameters(max_new_tokens=STREAM_TOKENS,
                                                   ignore_eos=True),
            )
            messages = []
            for message in stub.GenerateStream(request, timeout=300):
                messages.append(message)
                if len(messages) == 2:
                    process.send_signal(signal.SIGTERM)
                    draining_since = time.monotonic()
                    time.sleep(0.5)  # the server handles the signal
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.Generate(generate_pb2.GenerateRequest(inputs="Hi"), timeout=30)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            drained_s = time.monotonic() - draining_since
        assert len(messages) == STREAM_TOKENS
        assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert drained_s > 5, f"the stream only needed {drained_s:.1f} s: make it longer"
        assert process.wait(timeout=180) == 0
    finally:
        stop(process)
