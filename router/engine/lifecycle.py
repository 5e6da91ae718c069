"""What happens to a request as its tokens arrive, and when it ends.

:class:`Lifecycle` applies one call's tokens (time to first token, inter-token latency,
text and stop checks through :class:`~router.output.OutputProcessor`), ends a request
whose grammar failed on the shards, and finishes a request: its blocks are freed, the
shards are told it left, it is counted and it gets its one log line.
"""

from __future__ import annotations

import time

from loguru import logger

from router.metrics import Metrics
from router.output import OutputProcessor
from router.request import ErrorEvent, Finish, Sequence, Status
from router.scheduler import Scheduler
from router.shard_steps import ShardSteps, StepResults


class Lifecycle:
    """Applies tokens to sequences and ends them.

    Args:
        scheduler: frees blocks and removes finished sequences.
        shards: told which requests leave the shards.
        output: text, stop checks and stream events.
        metrics: request and token metrics.
    """

    def __init__(self, scheduler: Scheduler, shards: ShardSteps, output: OutputProcessor,
                 metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.shards = shards
        self.output = output
        self.metrics = metrics
        # speculative decoding's guesses so far (the counters of /metrics, for /info)
        self.guesses_proposed = 0
        self.guesses_accepted = 0

    def admitted(self, sequences: list[Sequence]) -> None:
        """Count the queue time and prompt tokens of newly admitted sequences (not of a
        recompute after preemption)."""
        now = time.monotonic()
        for seq in sequences:
            if seq.admitted_time is None:
                seq.admitted_time = now
                self.metrics.queue_time.observe(now - seq.arrival_time)
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def apply(self, sampled: list[tuple[Sequence, int]], results: StepResults) -> None:
        """Apply one call's tokens to the sequences they were sampled for: only to a
        sequence still running in the epoch it was sent in (not finished, cancelled or
        preempted since). A speculative step's tokens of a sequence are applied in order
        until one ends it: those after a stop are dropped, never streamed."""
        arrived = time.monotonic()
        ttft = self.metrics.time_to_first_token
        itl = self.metrics.inter_token_latency
        on_token = self.output.on_token
        extras = results.extras
        logprobs = results.logprobs
        token_ids = results.token_ids
        counts = results.num_tokens
        running = Status.RUNNING
        applied = 0
        if results.grammar_failures:  # these end now: the loop below skips them
            self._fail_grammars(sampled, results.grammar_failures)
        if results.num_proposed is not None:
            decode_s = self.scheduler.prefill_budget.decode_s
            cost = results.forward_s / decode_s if decode_s else None
            self._count_guesses(sampled, results.num_proposed, counts or [], cost)
        start = 0
        for index, (seq, epoch) in enumerate(sampled):
            first = start
            start += 1 if counts is None else counts[index]
            if seq.epoch != epoch or seq.status is not running:
                continue
            seq.pending_tokens -= 1
            if seq.cancelled:
                continue
            for position in range(first, start):
                token_id = token_ids[position]
                seq.output_ids.append(token_id)
                if seq.first_token_time is None:
                    seq.first_token_time = arrived
                    ttft.observe(arrived - seq.arrival_time)
                elif seq.last_token_time is not None:
                    itl.observe(arrived - seq.last_token_time)
                seq.last_token_time = arrived
                finish = on_token(seq, token_id, logprobs[position],
                                  None if extras is None else extras[position])
                applied += 1
                if finish is not None:
                    self.finish(seq, "success", finish)
                    break
        self.metrics.generation_tokens.inc(applied)

    def _count_guesses(self, sampled: list[tuple[Sequence, int]], proposed: list[int],
                       counts: list[int], cost: float | None) -> None:
        """A speculative step's guesses: the metrics, and each sequence's acceptance
        (:class:`~router.acceptance.SpeculationStats`, which pauses its guesses when
        they are mostly rejected or do not pay for the step's ``cost``: its time over
        a plain decode step's, None when no decode step is measured)."""
        metrics = self.metrics
        for (seq, _), guesses, emitted in zip(sampled, proposed, counts, strict=True):
            if guesses:
                self.guesses_proposed += guesses
                self.guesses_accepted += emitted - 1
                metrics.proposed_tokens.inc(guesses)
                metrics.accepted_tokens.inc(emitted - 1)
                metrics.verifications.inc()
                seq.speculation.record(guesses, emitted - 1, cost)

    def _fail_grammars(self, sampled: list[tuple[Sequence, int]], failures: dict[int, str]
                       ) -> None:
        """End each sequence of ``sampled`` still running in its epoch whose grammar
        failed on the shards (``failures``: id -> why) with an :class:`ErrorEvent`
        after the tokens it already has; its token of this step is void."""
        self.output.deliver()  # the tokens before the failure come first
        for seq, epoch in sampled:
            why = failures.get(seq.id)
            if (why is None or seq.epoch != epoch or seq.status is not Status.RUNNING
                    or seq.cancelled):
                continue
            logger.warning("request {}: its grammar failed on the shards: {}", seq.id, why)
            seq.events.put_nowait(ErrorEvent(
                message=f"grammar: failed after {len(seq.output_ids)} generated tokens "
                        f"({why}); no output can follow it: simplify the grammar",
                grammar=True,
            ))
            self.finish(seq, "error")

    def finish(self, seq: Sequence, outcome: str, finish: Finish | None = None) -> None:
        """Free ``seq``'s blocks, let it leave the shards, count it and write its one
        log line. ``outcome``: "success", "cancelled" or "error"."""
        self.scheduler.finish(seq)
        self.shards.release(seq.id)
        self.output.remove(seq.id)
        now = time.monotonic()
        self.metrics.requests.labels(outcome).inc()
        if outcome == "success":
            self.metrics.e2e_latency.observe(now - seq.arrival_time)
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        logger.bind(request_id=seq.id).info(
            "request {} {}: prompt_tokens={} generated_tokens={} finish_reason={} "
            "queue_s={:.3f} ttft_s={} e2e_s={:.3f}",
            seq.id, outcome, len(seq.prompt_ids), len(seq.output_ids),
            finish.reason.value if finish else None,
            (seq.admitted_time or now) - seq.arrival_time,
            None if ttft is None else round(ttft, 3), now - seq.arrival_time,
        )
