"""Steps launched on the device and not read yet, and their device time.

The runner launches step N+1 while step N computes (:meth:`ModelRunner.launch_prefill`,
:meth:`ModelRunner.launch_decode`) and reads a step's tokens later
(:meth:`ModelRunner.finish_step`); a :class:`PendingStep` is what lies between the two,
and a :class:`StepChain` keeps them in launch order and reads them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import torch

from shard.host_copy import HostCopy
from shard.records import Generation, StepOutput, TopToken
from shard.requests import RequestState
from shard.sampling import SamplerOutput
from shard.step_trace import NullTrace, Trace


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
        trace_step: the router's step number, for the step trace (-1: none).
        previous_timer: the device timer of the step launched before it, of any kind,
            for the device's idle time between the two.
        prompt_logprobs: a prefill's prompt logprobs per request (computed at launch,
            only for the requests that asked); empty for a decode.
        has_grammar: some request is constrained by a grammar (the failed ones are
            reported with the step's results).
        num_rows: a mixed step's decoding rows, the first ``num_rows`` of ``requests``.
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
    num_rows: int = 0


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

    def trace_gap_after(self, previous: StepTimer | None, step: int, trace: Trace) -> None:
        """Record ``device_gap`` for ``step`` in ``trace`` (µs since ``previous`` ended on
        the device), when tracing is on and the gap is known."""
        if not trace.enabled or previous is None:
            return
        gap = self.gap_ns_after(previous)
        if gap is not None:
            trace.mark("device_gap", step, gap // 1000)

    def elapsed_ns(self) -> int:
        """Nanoseconds; on CUDA call once the step's results are read."""
        if self._events is not None:
            return int(self._events[0].elapsed_time(self._events[1]) * 1e6)
        return self._end_ns - self._start_ns


class StepChain:
    """The steps one runner launched, read in launch order: each launched step that
    samples is chained after the one before it (:attr:`PendingStep.previous`), and the
    device timer of the last launched step of any kind is kept (the device's idle time
    before the next one).

    Args:
        trace: where a read step's ``ready`` and ``device_gap`` points go
            (:mod:`shard.step_trace`).
    """

    def __init__(self, trace: Trace | None = None) -> None:
        self.trace = trace if trace is not None else NullTrace()
        self.last: PendingStep | None = None  # the last launched step that samples
        self.last_timer: StepTimer | None = None

    def launched(
        self,
        requests: list[RequestState],
        out: SamplerOutput,
        timer: StepTimer,
        previous_timer: StepTimer | None,
        trace_step: int = -1,
        prompt_logprobs: tuple[tuple[float, ...], ...] = (),
        has_grammar: bool = False,
        num_rows: int = 0,
    ) -> PendingStep:
        """The launched step whose sampled ``out`` is on its way to the host, chained
        after the last launched one (finished first); the fields are
        :class:`PendingStep`'s."""
        pending = PendingStep(
            requests=requests,
            host=HostCopy([out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs]),
            timer=timer,
            previous=self.last,
            trace_step=trace_step,
            previous_timer=previous_timer,
            prompt_logprobs=prompt_logprobs,
            has_grammar=has_grammar,
            num_rows=num_rows,
        )
        self.last = pending
        return pending

    def unsampled(self, timer: StepTimer, previous_timer: StepTimer | None,
                  trace_step: int = -1) -> None:
        """A launched step that samples nothing (a prefill of partial chunks only): its
        timer is the last one; traced, the host waits for it (nothing else is read
        back) to record the device's idle time before it."""
        timer.stop()
        self.last_timer = timer
        if self.trace.enabled:
            timer.synchronize()
            timer.trace_gap_after(previous_timer, trace_step, self.trace)

    def wait_last(self, timeout_s: float = 120.0) -> None:
        """Block until the last launched step is finished (its tokens recorded).

        Raises:
            RuntimeError: it was not finished within ``timeout_s`` seconds.
        """
        pending = self.last
        if pending is not None and not pending.finished.wait(timeout_s):
            raise RuntimeError(
                f"the previous step was not finished within {timeout_s:.0f} s"
            )

    def finish(self, pending: PendingStep) -> StepOutput:
        """Wait for ``pending``'s results (after the step launched before it is
        finished) and record its tokens in its requests (see
        :meth:`ModelRunner.finish_step`).

        Raises:
            RuntimeError: the step launched before it was not finished within 120 s.
        """
        try:
            if pending.previous is not None and not pending.previous.finished.wait(120.0):
                raise RuntimeError("the previous step was not finished within 120 s")
            pending.previous = None  # let the chain be freed
            tokens, logprobs, top_ids, top_lps = pending.host.wait()
            self.trace.mark("ready", pending.trace_step)
            pending.timer.trace_gap_after(pending.previous_timer, pending.trace_step,
                                          self.trace)
            pending.previous_timer = None
            assert tokens is not None and logprobs is not None
            out = SamplerOutput(tokens, logprobs, top_ids, top_lps)
            requests = pending.requests
            generations = _generations(
                [r.request_id for r in requests],
                [r.top_n_tokens for r in requests],
                out,
                pending.prompt_logprobs or [()] * len(requests),
            )
            for r, g in zip(requests, generations, strict=True):
                r.record_token(g.token_id)
            failures = [(r.request_id, failure) for r in requests if r.grammar is not None
                        and (failure := r.grammar.failure) is not None
                        ] if pending.has_grammar else []
        finally:
            pending.finished.set()
        return StepOutput(tuple(generations), pending.timer.elapsed_ns(), tuple(failures),
                          num_rows=pending.num_rows)

    def reset(self) -> None:
        """Forget the launched steps (a new sequence of steps starts)."""
        self.last = None
        self.last_timer = None


def _generations(
    request_ids: Sequence[int],
    top_ns: Sequence[int],
    out: SamplerOutput,
    prompt_lps: Sequence[tuple[float, ...]],
) -> list[Generation]:
    """Convert a :class:`SamplerOutput` to per-request :class:`Generation` records."""
    tokens = out.token_ids.tolist()
    logprobs = out.logprobs.tolist()
    top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    if top_ids is None or top_lps is None:  # no request asked for alternatives
        return list(map(Generation, request_ids, tokens, logprobs, repeat(()), prompt_lps))
    result = []
    for i, rid in enumerate(request_ids):
        top: tuple[TopToken, ...] = ()
        if top_ns[i] > 0:
            top = tuple(
                TopToken(t, lp)
                for t, lp in zip(top_ids[i][: top_ns[i]], top_lps[i][: top_ns[i]], strict=True)
            )
        result.append(Generation(rid, tokens[i], logprobs[i], top, prompt_lps[i]))
    return result
