"""A SIGTERM sent to the server's whole process group (``kill -- -PGID``, ``timeout``,
systemd's default ``KillMode=control-group``) also reaches the local Ray instance the
launcher started: the server still drains, says ``stopped`` and exits 0 at once,
without waiting for the lost Ray processes, and leaves none behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import STARTUP_TIMEOUT_S, wait_healthy
from tests.ports import unused_port

pytestmark = pytest.mark.e2e


def test_sigterm_to_the_process_group_stops_the_ray_server_cleanly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = unused_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "launch", "--model", str(tiny_model_dir),
             "--executor", "ray", "--host", "127.0.0.1", "--port", str(port),
             "--grpc-port", "0", "--max-total-tokens", "512"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, process, STARTUP_TIMEOUT_S)
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 4}}
        assert httpx.post(f"{base_url}/generate", json=body, timeout=60).status_code == 200
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)  # the launcher, Ray's GCS and raylet alike
        code = process.wait(timeout=50)  # Ray's GCS client alone would wait 60 s
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log_text = log_path.read_text()
    assert code == 0, log_text[-3000:]
    assert took < 30, f"{took:.1f} s to stop"
    assert "the local Ray instance was stopped too" in log_text
    assert log_text.rstrip().endswith("stopped"), log_text[-2000:]
    # Ray's workers exit once their raylet is gone (a zombie waiting for init to reap
    # it is no process left)
    deadline = time.monotonic() + 15
    while (leftovers := group_members(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers, f"processes left in the group: {leftovers}"


def group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``, as ``ps`` lines."""
    table = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True,
                           text=True).stdout
    return [line for line in table.splitlines()
            if line.split()[1] == str(pgid) and not line.split()[2].startswith("Z")]
