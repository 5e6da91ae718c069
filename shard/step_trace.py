"""Timestamps of each step's hops between the router and the shards, for finding where
the device waits (``benchmarks/step_chain.py`` reads them).

Off unless the environment variable ``STEP_TRACE_DIR`` names a folder when the process
starts; then :func:`mark` records ``(point, step, monotonic ns, value)`` and the rows are
appended to ``<dir>/<pid>.tsv`` every :data:`FLUSH_EVERY` marks and at exit. The clock is
``CLOCK_MONOTONIC`` (:func:`time.monotonic_ns`), shared by the processes of one host, so
the rows of the router and of the shards line up.

Points (``step`` is the router's step number, :attr:`DecodeRequest.step`, which the
shard echoes in its response; -1 for a step launched outside the servicer, as
``ModelRunner.decode`` does):

- router: ``send`` (a Decode is sent), ``recv`` (its response is read), ``applied``
  (its tokens are applied and the next step can be scheduled);
- shard: ``arrive`` (the Decode reaches the servicer), ``launched`` (its kernels are
  queued), ``ready`` (its sampled ids reached the host: the device finished it),
  ``answer`` (its response is built), ``prefill`` (a Prefill's response is built;
  carries its forward's host time in µs), ``device_gap`` (a Prefill or Decode: carries
  the device time in µs between the end of the previous step's kernels, of any kind,
  and the start of this one's, by CUDA events: the device's idle time; a prefill's
  starts once the host has built its inputs).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

FLUSH_EVERY = 512

_dir = os.environ.get("STEP_TRACE_DIR")
_rows: list[tuple[str, int, int, int]] = []
_lock = threading.Lock()
enabled = bool(_dir)


def mark(point: str, step: int = -1, value: int = 0) -> None:
    """Record ``point`` of ``step`` now (a no-op unless tracing is on); ``value``: a
    number the point carries (``send``: the step's requests; ``answer``: its device
    time in µs)."""
    if not enabled:
        return
    _rows.append((point, step, time.monotonic_ns(), value))  # list.append is atomic
    if len(_rows) >= FLUSH_EVERY:
        flush()


def flush() -> None:
    """Append the recorded rows to this process's file."""
    if not enabled or not _rows:
        return
    with _lock:
        rows = _rows[:]
        del _rows[: len(rows)]
        assert _dir is not None
        path = Path(_dir) / f"{os.getpid()}.tsv"
        with path.open("a") as f:
            f.writelines(f"{point}\t{step}\t{ns}\t{value}\n" for point, step, ns, value in rows)


if enabled:
    Path(_dir or ".").mkdir(parents=True, exist_ok=True)
    atexit.register(flush)
