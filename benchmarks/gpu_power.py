"""The GPU's power draw, clocks and throttle reasons over a run, sampled by ``nvidia-smi``
in the background, and what they were over a window of time (one pass of a workload):
mean power, energy, SM clock, and the share of samples held back by the power cap.

Where the board's power limit binds (throttle reason "SW power cap", SM clock below its
maximum), a step cannot run faster without using less energy: throughput is then the
power limit over the energy per token, and the energy per output token is the figure to
compare between engines doing the same arithmetic.

Each sample carries ``nvidia-smi``'s own timestamp. Power is ``power.draw.instant``
where the driver has it: on Ampere and later ``power.draw`` is a one-second average, which
would credit a short window with the phase before it. Source: ``nvidia-smi
--help-query-gpu`` (``timestamp``, ``power.draw``, ``power.draw.instant``, ``clocks.sm``,
``clocks_throttle_reasons.active``, a bitmask of NVML's ``nvmlClocksThrottleReason*``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap
HW_SLOWDOWN = 0x8  # nvmlClocksThrottleReasonHwSlowdown (thermal or power brake)
OTHER_FIELDS = "clocks.sm,clocks.mem,clocks_throttle_reasons.active"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, local time


@dataclass(frozen=True)
class Sample:
    """One ``nvidia-smi`` line; ``t`` is its timestamp as ``time.time()`` seconds."""

    t: float
    watts: float
    sm_mhz: float
    mem_mhz: float
    reasons: int


def parse_sample(line: str) -> Sample | None:
    """A :class:`Sample` from a ``--format=csv,noheader,nounits`` line of ``timestamp``,
    a power field and :data:`OTHER_FIELDS`, or None for a line that is not one (a
    header, ``[N/A]``, an error)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5:
        return None
    try:
        t = datetime.datetime.strptime(fields[0], TIMESTAMP).timestamp()
        return Sample(t, float(fields[1]), float(fields[2]), float(fields[3]),
                      int(fields[4], 16))
    except ValueError:
        return None


def nvidia_smi_id(cuda_index: int) -> str:
    """The ``nvidia-smi -i`` id of CUDA device ``cuda_index``: ``nvidia-smi`` numbers every
    GPU of the machine, CUDA only those ``CUDA_VISIBLE_DEVICES`` names (an index or a
    UUID each)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    if cuda_index < len(visible):
        return visible[cuda_index]
    return str(cuda_index)


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
        """Stats of ``samples`` over a window of ``seconds``; None when there are none."""
        if not samples:
            return None
        sm = [s.sm_mhz for s in samples]
        watts = [s.watts for s in samples]
        capped = sum(1 for s in samples if s.reasons & SW_POWER_CAP) / len(samples)
        return cls(len(samples), statistics.fmean(watts), max(watts), statistics.median(sm),
                   min(sm), capped, seconds)


class PowerLog:
    """``nvidia-smi`` sampling CUDA device ``index`` every ``interval_ms`` while started; a
    thread reads its lines. Does nothing where ``nvidia-smi`` is missing (:meth:`window`
    then returns None). Also a context manager (start, stop).

    Attributes:
        samples: what was read so far.
        power_field: ``power.draw.instant`` or, where the driver lacks it,
            ``power.draw``; set by :meth:`start`.
        errors: what ``nvidia-smi`` wrote on stderr (a rejected field, a missing GPU).
    """

    def __init__(self, index: int = 0, interval_ms: int = 50) -> None:
        self.index, self.interval_ms = index, interval_ms
        self.samples: list[Sample] = []
        self.power_field = "power.draw.instant"
        self.errors = ""
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling; False when ``nvidia-smi`` is not there."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return False
        gpu = nvidia_smi_id(self.index)
        probe = subprocess.run([exe, "-i", gpu, "--query-gpu=power.draw.instant",
                                "--format=csv,noheader,nounits"], capture_output=True,
                               text=True, timeout=30, check=False)
        if probe.returncode != 0 or "N/A" in probe.stdout or not probe.stdout.strip():
            self.power_field = "power.draw"  # an older driver: the one-second average
        self._proc = subprocess.Popen(
            [exe, "-i", gpu, f"--query-gpu=timestamp,{self.power_field},{OTHER_FIELDS}",
             "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            start_new_session=True)  # its own process group: stop() ends all of it
        self._reader = threading.Thread(target=self._read, name="power-log", daemon=True)
        self._reader.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        """End the sampler (its whole process group) and keep its stderr in
        :attr:`errors`; says so on stderr when no sample came. Samples stay readable."""
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
        if self._proc.stderr is not None:
            self.errors = self._proc.stderr.read().strip()
        if not self.samples:
            print(f"gpu_power: no samples from nvidia-smi ({self.errors or 'no output'})",
                  file=sys.stderr)
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
