"""A shard process started with ``--parent-pid`` stops once the process that started it
is gone, even killed by SIGKILL: the local executor starts shards in sessions of their
own (Ctrl-C reaches the launcher, which stops them), so a launcher that dies before it
can stop them would otherwise leave them running with their memory (a GPU's)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import unused_port

# The launcher's part: start a shard in a session of its own, say its pid, wait.
LAUNCHER = """
import os, subprocess, sys
model, port, watch = sys.argv[1], sys.argv[2], sys.argv[3] == "watch"
argv = [sys.executable, "-m", "shard.server", "--model", model, "--port", port,
        "--device", "cpu", "--kv-cache-bytes", str(4 * 1024 * 1024)]
if watch:
    argv += ["--parent-pid", str(os.getpid())]
shard = subprocess.Popen(argv, start_new_session=True)
print(shard.pid, flush=True)
shard.wait()
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie its new parent has not reaped yet has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the shard never listened"
            time.sleep(0.2)


@pytest.mark.parametrize(("watch", "killed_when"), [(True, "loading"), (True, "serving"),
                                                     (False, "serving")])
def test_a_shard_stops_once_its_launcher_is_killed(
    tiny_model_dir: Path, watch: bool, killed_when: str,
) -> None:
    port = unused_port()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny_model_dir), str(port),
         "watch" if watch else "no-watch"], stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        if killed_when == "serving":
            _wait_listening(port, 120.0)
        launcher.kill()  # no chance to stop its shard
        launcher.wait()
        if not watch:
            # the control: without the flag nothing stops it (the session of its own)
            time.sleep(3.0)
            assert _running(pid)
            return
        deadline = time.monotonic() + 60.0
        while _running(pid):
            assert time.monotonic() < deadline, "the shard outlived its launcher"
            time.sleep(0.2)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()
