"""Steps launched on the device and not read yet, and their device time.

The runner launches step N+1 while step N computes (:meth:`ModelRunner.launch_prefill`,
:meth:`ModelRunner.launch_decode`) and reads a step's tokens later
(:meth:`ModelRunner.finish_step`); a :class:`PendingStep` is what lies between the two.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from shard import step_trace
from shard.host_copy import HostCopy
from shard.requests import RequestState


@dataclass
class PendingStep:
    """A prefill or decode step launched on the device whose results are not read yet.

    Attributes:
        requests: the rows it samples, in order (a decode: every decoding row at launch;
            a prefill: the requests whose prompt it completed, whose first token is
            recorded when the step is read).
        host: the sampled ids, logprobs and top tokens, on their way to the host.
        timer: the step's device time.
        previous: the step launched before it (finished first, so that the tokens of
            a request are recorded in order).
        finished: set once :meth:`ModelRunner.finish_step` has recorded the tokens.
        trace_step: the router's step number, for :mod:`shard.step_trace` (-1: none).
        previous_timer: the device timer of the step launched before it, of any kind,
            for the device's idle time between the two.
        prompt_logprobs: a prefill's prompt logprobs per request (computed at launch,
            only for the requests that asked); empty for a decode.
        has_grammar: some request is constrained by a grammar (the failed ones are
            reported with the step's results).
    """

    requests: list[RequestState]
    host: HostCopy
    timer: StepTimer
    previous: PendingStep | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    trace_step: int = -1
    previous_timer: StepTimer | None = None
    prompt_logprobs: tuple[tuple[float, ...], ...] = ()
    has_grammar: bool = False


class StepTimer:
    """Device time of a step: CUDA events around its kernels (the time the device spent
    on it, not the host's), or the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._start_ns = time.perf_counter_ns()
        self._end_ns = self._start_ns
        if device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._end_ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        """Wait until the device has run the step (a no-op off CUDA)."""
        if self._events is not None:
            self._events[1].synchronize()

    def gap_ns_after(self, previous: StepTimer) -> int | None:
        """Device time between the end of ``previous`` (the timer of the step launched
        just before, of any kind) and the start of this one, nanoseconds: how long the
        device sat idle between them. None off CUDA. Call once this step's results are
        read."""
        if self._events is None or previous._events is None:
            return None
        return int(previous._events[1].elapsed_time(self._events[0]) * 1e6)

    def trace_gap_after(self, previous: StepTimer | None, step: int) -> None:
        """Record ``device_gap`` for ``step`` in :mod:`shard.step_trace` (µs since
        ``previous`` ended on the device), when tracing is on and the gap is known."""
        if not step_trace.enabled or previous is None:
            return
        gap = self.gap_ns_after(previous)
        if gap is not None:
            step_trace.mark("device_gap", step, gap // 1000)

    def elapsed_ns(self) -> int:
        """Nanoseconds; on CUDA call once the step's results are read."""
        if self._events is not None:
            return int(self._events[0].elapsed_time(self._events[1]) * 1e6)
        return self._end_ns - self._start_ns
