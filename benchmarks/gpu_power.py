"""The GPU's power draw, clocks and throttle reasons over a run, sampled by ``nvidia-smi``
in the background, and what they were over a window of time (one pass of a workload):
mean power, energy, SM clock, and the share of samples held back by the power cap.

Where the board's power limit binds (throttle reason "SW power cap", SM clock below its
maximum), a step cannot run faster without using less energy: throughput is then the
power limit over the energy per token, and the energy per output token is the figure to
compare between engines doing the same arithmetic.

Source: ``nvidia-smi --help-query-gpu`` (``power.draw``, ``clocks.sm``,
``clocks_throttle_reasons.active``, a bitmask of NVML's ``nvmlClocksThrottleReason*``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap
HW_SLOWDOWN = 0x8  # nvmlClocksThrottleReasonHwSlowdown (thermal or power brake)
FIELDS = "power.draw,clocks.sm,clocks.mem,clocks_throttle_reasons.active"


@dataclass(frozen=True)
class Sample:
    """One ``nvidia-smi`` line, stamped with ``time.time()`` when it was read."""

    t: float
    watts: float
    sm_mhz: float
    mem_mhz: float
    reasons: int


def parse_sample(line: str, t: float) -> Sample | None:
    """A :class:`Sample` from a ``--format=csv,noheader,nounits`` line of :data:`FIELDS`,
    or None for a line that is not one (a header, ``[N/A]``, an error)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        return Sample(t, float(fields[0]), float(fields[1]), float(fields[2]),
                      int(fields[3], 16))
    except ValueError:
        return None


@dataclass(frozen=True)
class PowerStats:
    """The samples of one window.

    Attributes:
        samples: how many.
        mean_w, max_w: board power, watts.
        sm_mhz_p50, sm_mhz_min: SM clock, MHz.
        capped: share of samples with the software power cap throttling the clocks.
        seconds: the window's length.
    """

    samples: int
    mean_w: float
    max_w: float
    sm_mhz_p50: float
    sm_mhz_min: float
    capped: float
    seconds: float

    @property
    def energy_j(self) -> float:
        """Energy over the window, joules (mean power × length)."""
        return self.mean_w * self.seconds

    @classmethod
    def of(cls, samples: list[Sample], seconds: float) -> PowerStats | None:
        if not samples:
            return None
        sm = [s.sm_mhz for s in samples]
        watts = [s.watts for s in samples]
        capped = sum(1 for s in samples if s.reasons & SW_POWER_CAP) / len(samples)
        return cls(len(samples), statistics.fmean(watts), max(watts), statistics.median(sm),
                   min(sm), capped, seconds)


class PowerLog:
    """``nvidia-smi`` sampling GPU ``index`` every ``interval_ms`` while started; a thread
    reads its lines and stamps them. Does nothing where ``nvidia-smi`` is missing
    (:meth:`window` then returns None). Also a context manager (start, stop)."""

    def __init__(self, index: int = 0, interval_ms: int = 50) -> None:
        self.index, self.interval_ms = index, interval_ms
        self.samples: list[Sample] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling; False when ``nvidia-smi`` is not there."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return False
        self._proc = subprocess.Popen(
            [exe, "-i", str(self.index), f"--query-gpu={FIELDS}",
             "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=True)  # its own process group: stop() ends all of it
        self._reader = threading.Thread(target=self._read, name="power-log", daemon=True)
        self._reader.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line, time.time())
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._proc = None

    def window(self, t0: float, t1: float) -> PowerStats | None:
        """Stats of the samples stamped within ``[t0, t1]`` (``time.time()`` seconds)."""
        return PowerStats.of([s for s in self.samples if t0 <= s.t <= t1], t1 - t0)

    def __enter__(self) -> PowerLog:
        self.start()
        time.sleep(0.2)  # nvidia-smi's first sample
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
