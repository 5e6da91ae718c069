"""Timestamps of each step's hops through a shard, for finding where the device waits
(``benchmarks/steps/step_chain.py`` reads them, beside the router's own,
:mod:`router.step_trace`).

Off unless ``--step-trace-dir`` (:attr:`ShardConfig.step_trace_dir`) names a folder:
:func:`from_config` then gives a :class:`StepTrace`, whose :meth:`~StepTrace.mark`
records ``(point, step, monotonic ns, value)`` and appends the rows to
``<dir>/<pid>.tsv`` every :data:`FLUSH_EVERY` marks and at exit; otherwise a
:class:`NullTrace`, whose marks do nothing. The clock is ``CLOCK_MONOTONIC``
(:func:`time.monotonic_ns`), shared by the processes of one host, so the rows of the
router and of the shards line up.

Points (``step`` is the router's step number, :attr:`DecodeRequest.step`, which the
shard echoes in its response; -1 for a step launched outside the servicer, as
``ModelRunner.decode`` does): ``arrive`` (the Decode reaches the servicer), ``launched``
(its kernels are queued), ``ready`` (its sampled ids reached the host: the device
finished it), ``answer`` (its response is built), ``prefill`` (a Prefill's response is
built; carries its forward's host time in µs), ``device_gap`` (a Prefill or Decode:
carries the device time in µs between the end of the previous step's kernels, of any
kind, and the start of this one's, by CUDA events: the device's idle time; a prefill's
starts once the host has built its inputs).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

from shard.config import ShardConfig

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
        """Record ``point`` of ``step`` now; ``value``: a number the point carries (the
        shard's ``answer``: the step's device time in µs; the router's ``send``: the
        rows the step steps)."""
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


def from_config(config: ShardConfig) -> Trace:
    """The trace ``config.step_trace_dir`` asks for: a :class:`StepTrace` into that
    folder, or a :class:`NullTrace` when it is empty."""
    return StepTrace(config.step_trace_dir) if config.step_trace_dir else NullTrace()
