"""Ray on one node (the tiny model): the shard gRPC servers bind loopback, since the
router runs on the same host; the log, written to a file, carries no ANSI colour codes
from Ray's prefixes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.live_server import LiveServer, launch_tiny

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ray_tiny(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("ray-tiny") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--executor", "ray"])
    yield live
    live.stop()


def wait_for(server: LiveServer, pattern: str, timeout_s: float = 30.0) -> list[str]:
    """Matches of ``pattern`` in the server log, waiting for at least one (shard lines
    reach the driver's log asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not (found := re.findall(pattern, server.log())) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def test_shards_bind_loopback_on_a_single_node(ray_tiny: LiveServer) -> None:
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{ray_tiny.url}/generate", json=body, timeout=60).status_code == 200
    assert "shard gRPC servers bind 127.0.0.1" in ray_tiny.log()
    assert wait_for(ray_tiny, r"listening on (\S+):\d+") == ["127.0.0.1"]


def test_log_file_has_no_ansi_escapes(ray_tiny: LiveServer) -> None:
    assert wait_for(ray_tiny, r"\(ShardActor pid=\d+\)")  # shard lines reached the driver
    log = ray_tiny.log()
    assert "\x1b[" not in log, [line for line in log.splitlines() if "\x1b[" in line][:5]
