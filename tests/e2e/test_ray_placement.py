"""The Ray executor never waits silently for resources: a group larger than this
machine's cores still starts on a Ray instance the launcher starts itself, and on an
existing cluster that lacks resources the wait says what is missing, then fails after
--placement-timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import save_tiny_llama
from tests.e2e.conftest import stop, wait_healthy
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

NUM_SHARD = 3  # more ranks than the 2 cores this suite runs on


@pytest.fixture(scope="module")
def three_head_model_dir(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny Llama that splits over three ranks (3 heads, 3 KV heads)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-3-heads"), default_model_dir,
                           num_attention_heads=3, num_key_value_heads=3, intermediate_size=96)


def test_more_ranks_than_cores_start_on_the_launchers_own_ray(
    three_head_model_dir: Path, tmp_path: Path
) -> None:
    port = unused_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "launch", "--model", str(three_head_model_dir),
             "--num-shard", str(NUM_SHARD), "--executor", "ray", "--grpc-port", "0",
             "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "256"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, 300)
        started = re.search(r"started a local Ray instance with (\d+) CPUs", log_path.read_text())
        assert started is not None and int(started[1]) >= NUM_SHARD
        assert httpx.get(f"{base_url}/info", timeout=30).json()["num_shard"] == NUM_SHARD
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
        assert httpx.post(f"{base_url}/generate", json=body, timeout=120).status_code == 200
    finally:
        stop(process)


@pytest.fixture
def one_cpu_cluster(tmp_path: Path) -> Iterator[str]:
    """A Ray head with one CPU, run by ``ray start --block`` (stopped with it): its
    ``host:port``."""
    port = unused_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    log_path = tmp_path / "ray-head.log"
    with log_path.open("wb") as log:
        head = subprocess.Popen(
            ["ray", "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
             "--include-dashboard", "false", "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            assert head.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def test_missing_resources_are_logged_then_placement_times_out(
    tiny_model_dir: Path, one_cpu_cluster: str
) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "launch", "--model", str(tiny_model_dir),
         "--num-shard", "2", "--ray-address", one_cpu_cluster, "--placement-timeout", "25",
         "--port", "0", "--grpc-port", "0"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    waits = re.findall(r"still waiting for a placement group of 2 x \{'CPU': 1\.0\} \(PACK\) "
                       r"after (\d+) s: missing \{'CPU': 1\.0\}", output)
    # Logged every 10 s until the 25 s timeout.
    assert len(waits) == 2 and all(10 <= int(s) < 25 for s in waits), output[-3000:]
    assert "run `ray status`" in output
    assert "was not placed within 25 s (--placement-timeout)" in output
    assert time.monotonic() - started < 200
