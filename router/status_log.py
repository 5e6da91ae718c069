"""A one-line status of a busy server every few seconds (``--status-interval``):

    status: prompt 812.4 tok/s, generation 95.1 tok/s, running 3 reqs, waiting 0 reqs,
    KV cache 4.2% used, speculation 61% of 412 guesses accepted

(the speculation part only when guesses were proposed in the interval).

Throughputs are averages over the interval (prompt tokens admitted, tokens generated);
the rest is the state at the end of it. Nothing is logged while the server is idle.
Values are read from the engine's Prometheus registry, so the line and ``/metrics``
always agree.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loguru import logger

from router.engine.loop import Engine
from router.metrics import PREFIX


@dataclass(frozen=True)
class _Sample:
    at: float  # time.monotonic(), seconds
    prompt_tokens: float
    generation_tokens: float
    running: float
    waiting: float
    kv_used: float
    kv_total: float
    proposed: float
    accepted: float


class StatusLogger:
    """Logs the status line of ``engine`` every ``interval_s`` seconds while busy.

    Args:
        engine: The serving engine (its metrics registry is read).
        interval_s: Seconds between lines (> 0).
    """

    def __init__(self, engine: Engine, interval_s: float) -> None:
        assert interval_s > 0, "the status interval must be positive"
        self.engine = engine
        self.interval_s = interval_s

    def _sample(self) -> _Sample:
        registry = self.engine.metrics.registry

        def value(name: str) -> float:
            return registry.get_sample_value(f"{PREFIX}_{name}") or 0.0

        return _Sample(
            at=time.monotonic(),
            prompt_tokens=value("prompt_tokens_total"),
            generation_tokens=value("generation_tokens_total"),
            running=value("running_batch_size"),
            waiting=value("queue_size"),
            kv_used=value("kv_blocks_used"),
            kv_total=value("kv_blocks_total"),
            proposed=value("spec_decode_proposed_tokens_total"),
            accepted=value("spec_decode_accepted_tokens_total"),
        )

    def line(self, before: _Sample, after: _Sample) -> str | None:
        """The status line for the interval between two samples; None when idle."""
        elapsed = max(after.at - before.at, 1e-9)
        prompt = (after.prompt_tokens - before.prompt_tokens) / elapsed
        generation = (after.generation_tokens - before.generation_tokens) / elapsed
        if not (prompt or generation or after.running or after.waiting):
            return None
        kv = 100.0 * after.kv_used / after.kv_total if after.kv_total else 0.0
        line = (f"status: prompt {prompt:.1f} tok/s, generation {generation:.1f} tok/s, "
                f"running {after.running:.0f} reqs, waiting {after.waiting:.0f} reqs, "
                f"KV cache {kv:.1f}% used")
        proposed = after.proposed - before.proposed
        if proposed:
            accepted = after.accepted - before.accepted
            line += (f", speculation {100.0 * accepted / proposed:.0f}% of {proposed:.0f} "
                     "guesses accepted")
        return line

    async def run(self) -> None:
        """Log until cancelled."""
        before = self._sample()
        while True:
            await asyncio.sleep(self.interval_s)
            after = self._sample()
            line = self.line(before, after)
            if line is not None:
                logger.info(line)
            before = after
