"""When a decode step speculates, and how far each request may guess.

Speculation pays when guesses are accepted and compute is idle: a verify step of k + 1
tokens per request costs about one decode step while the batch is small (weights are
read once for all of them), and more as the batch grows. The policy:

- a step of more than ``speculative_disable_batch_size`` running requests, or one that
  also prefills prompts (a mixed step), runs without speculation;
- a request guesses at most ``num_speculative_tokens``, fewer near its ``max_new_tokens``
  or ``max_total_tokens`` (the tokens a step can emit never exceed them);
- a request whose recent guesses are mostly rejected pauses: with its acceptance
  (a moving average over its verify steps) under
  :data:`~router.acceptance.LOW_ACCEPTANCE` it guesses nothing for
  :data:`~router.acceptance.PAUSE_STEPS` steps, then tries again
  (:class:`~router.acceptance.SpeculationStats`).
"""

from __future__ import annotations

from router.config import SchedulerConfig
from router.request import Sequence


def lookahead(config: SchedulerConfig, decoding: list[Sequence]) -> dict[int, int]:
    """Guesses per request of a decode step over ``decoding`` (sequence id -> at most
    this many; 0 = none), or an empty dict: no speculation in this step. Counts down
    the pauses of the requests it leaves out for low acceptance.

    Args:
        config: ``num_speculative_tokens``, ``speculative_disable_batch_size`` and the
            token limits.
        decoding: the requests the step decodes (their ``pending_tokens`` not yet
            counting it; ``Sequence.speculation`` their :class:`SpeculationStats`).
    """
    k = config.num_speculative_tokens
    if not k or len(decoding) > config.speculative_disable_batch_size:
        return {}
    guesses: dict[int, int] = {}
    for seq in decoding:
        if seq.speculation.paused:
            seq.speculation.paused -= 1
            guesses[seq.id] = 0
            continue
        # tokens this step may emit: 1 + guesses, within both limits
        generated = len(seq.output_ids) + seq.pending_tokens
        room = min(
            seq.request.stopping.max_new_tokens - generated,
            config.max_total_tokens - len(seq.request.input_ids) - generated,
        )
        guesses[seq.id] = max(min(k, room - 1), 0)
    return guesses if any(guesses.values()) else {}
