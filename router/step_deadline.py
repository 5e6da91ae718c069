"""How long a Prefill or Decode call may take before its shard group counts as hung.

A fixed deadline is either too short for a legitimately slow step (a large prefill on
a CPU) or too long to notice a hang (requests stall for all of it). By default the
deadline follows the steps actually measured: ``max(floor_s, factor × slowest)``,
where ``slowest`` is the longest Prefill, Decode or Warmup seen so far. Warmup runs the
worst-case prefill (``--max-batch-prefill-tokens`` tokens), so it bounds every later
prefill from above before any has run; a deadline that only grows can never cut a step
shorter than one already completed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Deadline of any step, seconds, whatever was measured (gRPC, scheduling and a busy
# machine add latency that a fast model does not predict).
DEFAULT_FLOOR_S = 30.0
# A step may take this many times the slowest step seen before it counts as hung.
DEFAULT_FACTOR = 10.0


@dataclass
class StepDeadline:
    """Deadline of step RPCs, seconds.

    Attributes:
        fixed_s: ``--step-timeout`` when given (> 0): the deadline, whatever was measured.
        floor_s: Smallest adaptive deadline.
        factor: Adaptive deadline = ``max(floor_s, factor × slowest_s)``.
        slowest_s: Longest step observed so far (wall time at the router, seconds).
    """

    fixed_s: float | None = None
    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR
    slowest_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fixed_s is not None and self.fixed_s <= 0:
            raise ValueError("--step-timeout must be positive (or 0 for the adaptive deadline)")
        if self.floor_s <= 0 or self.factor < 1:
            raise ValueError("the step deadline needs floor_s > 0 and factor >= 1")

    @property
    def seconds(self) -> float:
        """The deadline of the next step, seconds."""
        if self.fixed_s is not None:
            return self.fixed_s
        return max(self.floor_s, self.factor * self.slowest_s)

    def observe(self, seconds: float) -> None:
        """Record a completed step of ``seconds`` (wall time)."""
        self.slowest_s = max(self.slowest_s, seconds)
