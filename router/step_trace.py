"""Timestamps of each decode step's hops through the router, for finding where the
device waits (``benchmarks/steps/step_chain.py`` reads them beside the shards' own, which
each shard writes itself: the router's trace is not part of the router ↔ shard
contract).

Off unless ``--step-trace-dir`` names a folder: :func:`step_trace` then gives a
:class:`StepTrace`, whose :meth:`~StepTrace.mark` records ``(point, step, monotonic ns,
value)`` and appends the rows to ``<dir>/<pid>.tsv`` every :data:`FLUSH_EVERY` marks and
at exit; otherwise a :class:`NullTrace`, whose marks do nothing. The clock is
``CLOCK_MONOTONIC`` (:func:`time.monotonic_ns`), shared by the processes of one host.

Points (``step``: the step number the router gives each Prefill and Decode): ``send``
(a Decode is sent; carries the rows it steps), ``recv`` (its response is read),
``applied`` (its tokens are taken in and the next step can be scheduled).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

FLUSH_EVERY = 512


class StepTrace:
    """Records marks and appends them to ``<folder>/<pid>.tsv`` (created if missing),
    every :data:`FLUSH_EVERY` marks and at the process's exit.

    Args:
        folder: where the file goes.
    """

    enabled: ClassVar[bool] = True

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / f"{os.getpid()}.tsv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rows: list[tuple[str, int, int, int]] = []
        self._lock = threading.Lock()
        atexit.register(self.flush)

    def mark(self, point: str, step: int = -1, value: int = 0) -> None:
        """Record ``point`` of ``step`` now; ``value``: a number the point carries
        (``send``: the rows the step steps)."""
        self._rows.append((point, step, time.monotonic_ns(), value))  # list.append is atomic
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Append the recorded rows to the file."""
        with self._lock:
            rows = self._rows[:]
            del self._rows[: len(rows)]
            if rows:
                with self.path.open("a") as f:
                    f.write("".join(f"{point}\t{step}\t{ns}\t{value}\n"
                                    for point, step, ns, value in rows))


class NullTrace:
    """Tracing off: :meth:`mark` and :meth:`flush` do nothing."""

    enabled: ClassVar[bool] = False

    def mark(self, point: str, step: int = -1, value: int = 0) -> None:
        """Nothing is recorded."""

    def flush(self) -> None:
        """Nothing to write."""


Trace = StepTrace | NullTrace


def step_trace(folder: str) -> Trace:
    """A :class:`StepTrace` into ``folder``, or a :class:`NullTrace` when it is empty."""
    return StepTrace(folder) if folder else NullTrace()
