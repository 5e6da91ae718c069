"""Pieces shared by the benchmark scripts: free ports, percentiles, the heading of a
result table (date, device, versions), the server as a child process through its CLI
(start, wait for ``/health``, stop with its shards), its Prometheus decode-step
histograms, and the measured copy bandwidth of a device.

Imported as ``benchmarks.harness`` by scripts run as ``python -m benchmarks.<group>.<name>``
from the repository root. It imports nothing of ``router`` or ``shard`` (torch only inside
the functions that need it), so a script can measure an older tree with it.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a log file ('' when it does not exist)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---- Prometheus metrics of the server ------------------------------------------------------

_WANTED = re.compile(r"^shardserve_((?:decode|prefill)_step_\w+_seconds_(?:sum|count)|"
                     r"prefix_cache_hit_tokens(?:_total)?) (\S+)$")


def scrape(text: str) -> dict[str, float]:
    """``_sum``/``_count`` of the step histograms and the prefix-cache counter from
    a Prometheus text exposition, keyed without the ``shardserve_`` prefix."""
    return {m[1]: float(m[2]) for line in text.splitlines() if (m := _WANTED.match(line))}


def metric_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per metric (a metric missing before counts as 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def decode_step_means(delta: Mapping[str, float]) -> tuple[float, float]:
    """Mean decode step over a run, seconds: (as the router sees it, around the gRPC call;
    the shard's forward), from ``_sum``/``_count`` deltas. NaN when no step ran."""

    def mean(name: str) -> float:
        count = delta.get(f"decode_step_{name}_seconds_count", 0.0)
        return delta.get(f"decode_step_{name}_seconds_sum", 0.0) / count if count else math.nan

    return mean("wall"), mean("duration")


def prefix_hits(delta: Mapping[str, float]) -> float:
    """Prompt tokens served from the prefix cache over a run."""
    return delta.get("prefix_cache_hit_tokens_total", delta.get("prefix_cache_hit_tokens", 0.0))


# ---- the server as a child process ---------------------------------------------------------

def start_server(port: int, model: str, extra: list[str], log_path: Path,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``shardserve launch --executor local`` on 127.0.0.1:``port`` (public gRPC API
    off), stdout and stderr into ``log_path``; ``env`` is added to this process's."""
    script = Path(sys.executable).with_name("shardserve")
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "router.cli"]
    cmd = [*entry, "launch", "--executor", "local", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", "0", *extra]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, cwd=REPO_ROOT)


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log_path: Path,
                 timeout: float) -> None:
    """Poll ``base/health`` every second until 200.

    Raises:
        ServerError: the process exited, or ``timeout`` seconds passed (then it is stopped).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"server exited ({proc.returncode}):\n{tail(log_path)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise ServerError(f"server not healthy after {timeout:.0f}s:\n{tail(log_path)}")


def find_shard(proc: subprocess.Popen[bytes]) -> psutil.Process:
    """The ``shard.server`` process started by the server ``proc``.

    Raises:
        RuntimeError: there is none.
    """
    for child in psutil.Process(proc.pid).children(recursive=True):
        if "shard.server" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no shard.server child process found")


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM the server, wait for it and for its shard processes to exit (so that their
    GPU memory is free), killing what is left after ``timeout`` seconds."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=10)


# ---- device ------------------------------------------------------------------------------

def today() -> str:
    """Today's date, ``YYYY-MM-DD``."""
    return datetime.date.today().isoformat()


def package_version(package: str) -> str:
    """The installed version of distribution ``package``, or ``absent``."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def versions(*packages: str) -> str:
    """``python 3.11.7, torch 2.5.1, ...``: this Python's version, then each distribution's
    (``absent`` where it is not installed)."""
    return ", ".join([f"python {platform.python_version()}",
                      *(f"{p} {package_version(p)}" for p in packages)])


def device_name(device: str) -> str:
    """What runs ``device``: the GPU's name for ``cuda``/``cuda:N``, else the CPU's model
    name with ``(CPU)``."""
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(device))
    return f"{cpu_model()} (CPU)"


def header(title: str, device: str, *packages: str) -> str:
    """The line heading a benchmark's table: ``# title, YYYY-MM-DD, device, python X, p Y``
    (``device`` as :func:`device_name` takes it, ``packages`` as :func:`versions`)."""
    return f"# {title}, {today()}, {device_name(device)}, {versions(*packages)}"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def copy_bandwidth(device: str = "cuda") -> float:
    """Copy bandwidth of ``device`` in bytes/s, bytes read + written, median time of a large
    ``Tensor.copy_``: 2 GiB buffers on CUDA (``triton.testing.do_bench``, eager), 256 MiB
    on CPU (wall clock of 10 copies)."""
    import torch

    if device.startswith("cuda"):
        import triton.testing

        src = torch.randn(2**29, device=device)
        dst = torch.empty_like(src)
        # NOTE: eager: a captured copy becomes a graph memcpy node run by the copy engine
        # (2.71 TB/s measured), not the copy kernel
        ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=15, rep=200,
                                           return_mode="median"))
        nbytes = 2 * src.numel() * src.element_size()
        del src, dst
        torch.cuda.empty_cache()
        return nbytes / (ms * 1e-3)
    src = torch.randn(2**26)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / percentile(times, 50)
