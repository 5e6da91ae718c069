"""The real server (Ray + gRPC shard + HTTP) on the default model, once per session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.ports import unused_port

STARTUP_TIMEOUT_S = 600.0
# Smaller budgets than the defaults keep warm-up (a worst-case prefill) short on CPU.
SMALL_BUDGETS = ["--max-batch-prefill-tokens", "512", "--max-input-tokens", "256",
                 "--max-total-tokens", "1024"]


def wait_healthy(base_url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll /health until 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not healthy after {timeout_s} s")


def launch(args: list[str], log_path: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Start ``shardserve launch`` with ``args`` on a free port; return (url, process).

    The public gRPC API is off unless ``args`` pass ``--grpc-port`` (so servers started
    side by side never fight over its default port).
    """
    port = unused_port()
    if "--grpc-port" not in args:
        args = [*args, "--grpc-port", "0"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "launch", "--host", "127.0.0.1",
             "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, STARTUP_TIMEOUT_S)
    except Exception:
        stop(process)
        sys.stderr.write(log_path.read_text()[-5000:])
        raise
    return base_url, process


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM the server and wait for it; return its exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@pytest.fixture(scope="session")
def grpc_port() -> int:
    """Port of the public gRPC API of :func:`ray_server`."""
    return unused_port()


@pytest.fixture(scope="session")
def grpc_address(ray_server: str, grpc_port: int) -> str:
    """``host:port`` of the public gRPC API of the session server."""
    return f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="session")
def ray_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, grpc_port: int
) -> Iterator[str]:
    """Base URL of the default model served through Ray (one shard), with its public
    gRPC API on :func:`grpc_port`."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    base_url, process = launch(
        ["--executor", "ray", "--grpc-port", str(grpc_port), *SMALL_BUDGETS], log_path
    )
    yield base_url
    stop(process)
