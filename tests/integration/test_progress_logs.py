"""What the server says while it starts and while it serves: each start-up wait is
announced (model load, warm-up and its phases, with a progress bar on a terminal), and
a busy server logs a status line every ``--status-interval`` seconds."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.live_server import TINY_BUDGETS, LiveServer, launch_tiny
from tests.ports import unused_port

STATUS = re.compile(
    r"status: prompt (?P<prompt>[\d.]+) tok/s, generation (?P<generation>[\d.]+) tok/s, "
    r"running (?P<running>\d+) reqs, waiting (?P<waiting>\d+) reqs, "
    r"KV cache (?P<kv>[\d.]+)% used"
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("progress") / "server.log"
    live = launch_tiny(tiny_model_dir, log_path, ["--status-interval", "0.3"])
    yield live
    live.stop()


def test_start_up_says_what_it_waits_for(server: LiveServer) -> None:
    log = server.log()
    order = ["waiting for 1 shard process(es) to load the model", "loading model from",
             "warming up 1 shard(s)", "warm-up 1/3: sizing the KV cache",
             "warm-up 2/3: allocating the KV cache", "warm-up 3/3: running the worst-case prefill",
             "warm-up done in", "serving"]
    positions = [log.find(text) for text in order]
    assert -1 not in positions, dict(zip(order, positions, strict=True))
    assert positions == sorted(positions)
    assert "\r" not in log  # no progress bar redraws in a log file


def status_lines(server: LiveServer) -> list[re.Match[str]]:
    return list(STATUS.finditer(server.log()))


def test_busy_server_logs_a_status_line(server: LiveServer) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
        time.sleep(0.05)
    assert json.loads(events[-1][5:])["details"]["generated_tokens"] == 400
    time.sleep(0.5)
    lines = status_lines(server)
    assert lines, server.log()[-3000:]
    busy = [m for m in lines if m["running"] == "1"]
    # (an interval can hold only the admission, or a stall of a loaded machine)
    assert any(float(m["generation"]) > 0 and float(m["kv"]) > 0 for m in busy), lines
    assert any(float(m["prompt"]) > 0 for m in lines)
    assert all(m["waiting"] == "0" for m in lines)
    # Idle: no more lines.
    time.sleep(0.6)
    count = len(status_lines(server))
    time.sleep(1.0)
    assert len(status_lines(server)) == count


def test_warm_up_draws_a_progress_bar_on_a_terminal(tiny_model_dir: Path) -> None:
    port = unused_port()
    controller, terminal = pty.openpty()
    # A terminal of 40 rows x 200 columns (a fresh pty has no size, and tqdm then hides).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "launch", "--model", str(tiny_model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", *TINY_BUDGETS],
        stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    os.close(terminal)
    output = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:
                return
            if not chunk:
                return
            output.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while b"serving" not in output:
            assert process.poll() is None and time.monotonic() < deadline, output.decode()[-3000:]
            time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=60)
        reader.join(timeout=10)
        os.close(controller)
    text = output.decode(errors="replace")
    assert re.search(r"warm-up: 100%\|█+\| 3/3 \[\d\d:\d\d\], done", text), text[-3000:]
    assert "warm-up 3/3: running the worst-case prefill" in text


def test_a_clean_stop_ends_the_log_with_its_own_lines(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    live = launch_tiny(tiny_model_dir, tmp_path / "server.log")
    assert httpx.post(f"{live.url}/generate", json={"inputs": "Hi"}, timeout=60).is_success
    assert live.stop() == 0
    lines = live.log().splitlines()
    # no teardown reports of extension modules ("nanobind: leaked ..."), and the last
    # line is the launcher's own
    assert not [line for line in lines if "leaked" in line], lines[-5:]
    assert re.search(r"\| INFO +\| .*- stopped$", lines[-1]), lines[-5:]
    # the shard's lines name its module, also when it runs as python -m shard.server
    assert "shard rank=0 | shard.server:" in live.log() and "__main__:" not in live.log()
