"""Tensor parallelism end to end: TP=2 over a two-node Ray cluster with spread
placement, recovery after a shard process is killed mid-generation, and a fast failure
for a shard count that cannot split the default model."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import launch, stop
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

RANK_LINE = re.compile(r"shard rank (\d+): pid (\d+) on node (\S+)")
# The tiny model's context is 512 tokens.
TINY_BUDGETS = ["--max-batch-prefill-tokens", "256", "--max-input-tokens", "128",
                "--max-total-tokens", "512"]
BODY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


def ranks_in_log(log_path: Path) -> dict[int, tuple[int, str]]:
    """{rank: (pid, node id)} from the launcher's latest ``shard rank`` lines."""
    return {int(m[1]): (int(m[2]), m[3]) for m in RANK_LINE.finditer(log_path.read_text())}


def generate(base_url: str) -> list[int]:
    body = {**BODY, "parameters": {**BODY["parameters"], "details": True}}
    response = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_num_shard_that_cannot_split_fails_fast(default_model_dir: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "launch", "--num-shard", "2", "--executor", "local"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "valid --num-shard values: 1, 3" in result.stderr + result.stdout
    assert time.monotonic() - started < 60


def _ray(*args: str, env: dict[str, str]) -> None:
    subprocess.run(["ray", *args], check=True, env=env, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[str]:
    """Two Ray nodes on this machine (head + worker, one CPU each); ``host:port``."""
    port = unused_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    try:
        _ray("start", "--head", "--port", str(port), "--num-cpus", "1",
             "--include-dashboard", "false", "--disable-usage-stats", env=env)
        _ray("start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1",
             "--disable-usage-stats", env=env)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(port)


def _stop_cluster(port: int) -> None:
    """Kill the processes of the Ray cluster whose GCS listens on ``port`` (and their
    children), not every Ray process of the machine as ``ray stop`` would: a server or
    another test run beside this one keeps its own Ray."""
    import psutil

    # the GCS's own flag, and the address every other process of the cluster is given
    # (the node's IP, not always 127.0.0.1)
    mark = re.compile(rf"(--gcs_server_port=|:){port}\b")
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if any(mark.search(arg) for arg in cmdline):
            for member in (process, *process.children(recursive=True)):
                found[member.pid] = member
    for process in found.values():
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(found.values()), timeout=30)


def test_tp2_spread_over_two_ray_nodes(
    tiny_model_dir: Path, two_node_cluster: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "spread.log"
    base_url, process = launch(
        ["--model", str(tiny_model_dir), "--num-shard", "2", "--ray-address", two_node_cluster,
         "--placement", "spread", *TINY_BUDGETS], log_path)
    try:
        ranks = ranks_in_log(log_path)
        assert sorted(ranks) == [0, 1]
        assert ranks[0][1] != ranks[1][1], f"both ranks on node {ranks[0][1]}"
        info = httpx.get(f"{base_url}/info", timeout=30).json()
        assert info["num_shard"] == 2
        assert len(generate(base_url)) == 8
    finally:
        stop(process)


def test_killed_shard_fails_requests_then_group_restarts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "kill.log"
    base_url, process = launch(
        ["--model", str(tiny_model_dir), "--num-shard", "2", "--executor", "local",
         "--max-restarts", "2", *TINY_BUDGETS], log_path)
    try:
        before = generate(base_url)
        victim = ranks_in_log(log_path)[1][0]
        body = {"inputs": "Once upon a time",
                "parameters": {"max_new_tokens": 480, "ignore_eos": True}}
        events: list[dict[str, object]] = []
        with httpx.stream("POST", f"{base_url}/generate_stream", json=body,
                          timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 3:
                        os.kill(victim, signal.SIGKILL)
                        killed_at = time.monotonic()
                        break
            for line in lines:
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
            ended_after = time.monotonic() - killed_at
        assert "error" in events[-1], events[-1]
        assert ended_after < 10, f"the stream ended {ended_after:.1f} s after the kill"
        assert httpx.get(f"{base_url}/health", timeout=30).status_code == 503
        deadline = time.monotonic() + 240
        while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:
            assert process.poll() is None, "the server exited instead of restarting"
            assert time.monotonic() < deadline, "the shard group did not come back"
            time.sleep(1)
        assert ranks_in_log(log_path)[1][0] != victim  # a new rank 1 process
        assert generate(base_url) == before
    finally:
        stop(process)
