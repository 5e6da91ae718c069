"""Shard calls sent and not yet read (overlapped scheduling), and the timing of each
step as the router sees it.

The engine sends step N+1 before it reads step N's results (``steps_in_flight``);
:class:`InFlightSteps` keeps the calls of each loop iteration, oldest first, and reads
one call's results into :class:`~router.shard_steps.StepResults`, observing the step
metrics on the way.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any

from router.metrics import Metrics
from router.request import Sequence
from router.shard_steps import ShardSteps, StepResults
from router.step_trace import NullTrace, Trace


@dataclass
class InFlight:
    """A shard call sent and not yet read.

    Attributes:
        task: the call.
        kind: "prefill", "decode", "speculative" (a decode that verifies guesses) or
            "mixed" (a prefill whose call also steps the decoding rows).
        sampled: the sequences it samples a token for, in response order, with the
            epoch each was in when sent (a token applies only in that epoch).
        sent_at: ``time.perf_counter()`` when sent, seconds.
        prompt_tokens: prompt tokens it computes (0 for a decode).
    """

    task: asyncio.Future[Any]
    kind: str
    sampled: list[tuple[Sequence, int]]
    sent_at: float
    prompt_tokens: int = 0

    @classmethod
    def sent(cls, task: asyncio.Future[Any], kind: str, sequences: list[Sequence]) -> InFlight:
        return cls(task, kind, [(seq, seq.epoch) for seq in sequences], time.perf_counter())


class InFlightSteps:
    """The calls of each loop iteration not read yet, oldest first.

    Args:
        metrics: where the step times go (``prefill_step``, ``decode_step``,
            ``decode_step_wall``).
        trace: where each Decode's ``applied`` goes (:mod:`router.step_trace`).
    """

    def __init__(self, metrics: Metrics, trace: Trace | None = None) -> None:
        self.metrics = metrics
        self.trace = trace if trace is not None else NullTrace()
        self._iterations: collections.deque[list[InFlight]] = collections.deque()
        self._decode_done = 0.0  # perf_counter() of the last decode result
        self._prefill_since_decode = False  # a prefill result came after it

    def __len__(self) -> int:
        """Iterations with calls not read yet."""
        return len(self._iterations)

    def add(self, calls: list[InFlight]) -> None:
        """The calls one loop iteration sent."""
        self._iterations.append(calls)

    def oldest(self) -> list[InFlight]:
        """Take the calls of the oldest iteration (to be read in order)."""
        return self._iterations.popleft()

    async def read(self, call: InFlight) -> StepResults:
        """Await ``call``'s response and turn it into per-token values.

        Raises:
            ShardError: the call failed.
        """
        try:
            response = await call.task
        finally:
            call.task.cancel()  # no-op once done; stops the call if the reader is cancelled
        now = time.perf_counter()
        metrics = self.metrics
        results: StepResults
        if call.kind not in ("decode", "speculative"):
            # a mixed step's rows come first; their ids matter only for top tokens
            sampled = ([seq.id for seq, _ in call.sampled]
                       if call.kind == "mixed" and response.decode.generations else None)
            results = ShardSteps.prefill_results(response, sampled)
            metrics.prefill_step.observe(results.forward_s)
            self._prefill_since_decode = True
        else:
            # the ids in row order are read only for the rows' top tokens, if any asked
            rows = [seq.id for seq, _ in call.sampled] if response.generations else []
            results = ShardSteps.decode_results(response, rows)
            # With calls overlapped, a step's wall time runs from the later of its send
            # and the previous step's result (the time the shards could work on it). A
            # prefill between the two is the prefill's time, counted by prefill_step.
            if not self._prefill_since_decode:
                metrics.decode_step_wall.observe(now - max(call.sent_at, self._decode_done))
            metrics.decode_step.observe(results.forward_s)
            if results.num_proposed is not None:
                metrics.propose_step.observe(results.propose_s)
                metrics.verify_step.observe(results.forward_s - results.propose_s)
            self._decode_done = now
            self._prefill_since_decode = False
            self.trace.mark("applied", response.step)
        counts = results.num_tokens
        assert len(counts or results.token_ids) == len(call.sampled) and (
            counts is None or sum(counts) == len(results.token_ids)), (
            f"{call.kind} returned {len(results.token_ids)} tokens ({counts}) for "
            f"{len(call.sampled)} requests"
        )
        return results

    def drop(self) -> None:
        """Forget every call (after a failure: their results no longer apply)."""
        for calls in self._iterations:
            for call in calls:
                call.task.cancel()
        self._iterations.clear()
