"""``shardserve launch`` as a child process on the tiny random Llama (local executor).

Starts in a few seconds on CPU, so API tests talk to the real server (uvicorn, the
public gRPC API, the launcher, a shard process) with real clients.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.ports import unused_port

# Small budgets keep warm-up short; the tiny model's context is 512 tokens.
TINY_BUDGETS = ["--executor", "local", "--max-batch-prefill-tokens", "256",
                "--max-total-tokens", "512", "--kv-cache-bytes", "8MiB"]
STARTUP_TIMEOUT_S = 120.0
_SHARD_PID = re.compile(r"shard rank (\d+): pid (\d+)")


@dataclass
class LiveServer:
    """A running server: HTTP at ``url``, public gRPC at ``grpc_address``."""

    url: str
    grpc_address: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """Everything the server (and its shards) wrote so far."""
        return self.log_path.read_text(errors="replace")

    def shard_pids(self) -> dict[int, int]:
        """``{rank: pid}`` from the latest ``shard rank R: pid P`` log lines."""
        return {int(rank): int(pid) for rank, pid in _SHARD_PID.findall(self.log())}

    def kill_shard(self, rank: int = 0) -> None:
        """SIGKILL one shard process (a crash, as the router sees it)."""
        os.kill(self.shard_pids()[rank], signal.SIGKILL)

    @contextlib.contextmanager
    def shard_stopped(self, rank: int = 0) -> Iterator[None]:
        """The shard process stopped (SIGSTOP) inside the block, so that no request
        makes progress, and resumed (SIGCONT) on leaving it. Keep it shorter than the
        liveness ping's timeout (5 s), after which the shard counts as dead."""
        pid = self.shard_pids()[rank]
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Poll ``/health`` until 200; fail early if the server exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self.log()[-5000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()[-5000:]}")

    def stop(self) -> int:
        """SIGTERM the server and wait for it; return its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch_tiny(
    model_dir: Path, log_path: Path, args: list[str] | None = None,
    env: dict[str, str] | None = None, wait: bool = True, model_flag: str = "--model",
    budgets: list[str] | None = None,
) -> LiveServer:
    """Start ``shardserve launch --model model_dir`` (``model_flag`` instead of
    ``--model``) on free ports with ``args`` after ``budgets`` (default: the tiny-model
    budgets; ``args`` override them) and ``env`` added to this process's environment;
    wait until healthy unless ``wait`` is False."""
    port, grpc_port = unused_port(), unused_port()
    full_env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "launch", model_flag, str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
             *(TINY_BUDGETS if budgets is None else budgets), *(args or [])],
            stdout=log, stderr=subprocess.STDOUT, env=full_env,
            # a process group of its own, as a server started from a terminal has (a
            # test may signal the group, as Ctrl-C does)
            start_new_session=True,
        )
    server = LiveServer(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", process, log_path)
    if wait:
        try:
            server.wait_healthy()
        except Exception:
            server.stop()
            raise
    return server
