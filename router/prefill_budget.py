"""How many prompt tokens a step may compute while requests decode, so that running
streams' inter-token gap stays near a target.

A mixed step (prompt chunks plus the decoding rows, one forward) takes about the
decode step's time plus a cost per prompt token; both are measured from the steps the
shards run, and the budget is the number of prompt tokens that fits in the target:
Sarathi-Serve's token budget derived from a time-between-tokens target (Agrawal et al.,
"Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024),
with the profile measured online instead of offline.
"""

from __future__ import annotations

# Weight of the newest measurement in the running estimates (an exponential moving
# average: about the last 1 / DECAY steps count).
DECAY = 0.2
# Without --itl-target: a step that prefills while requests decode may take this many
# decode steps ...
AUTO_TARGET_DECODE_STEPS = 3.0
# ... and at least this long, seconds. A GPU's decode step is a few milliseconds, but
# prompt tokens cost least in large steps: on an H100 (8B model, 512 x 1024-token
# prompts) steps of 50 ms computed ~970 prompt tokens each at 0.73x nano-vllm's
# throughput, while 0.1 s beat 0.2 s on every workload of the benchmark (bench 1.24x
# against 1.09x, prefill_heavy 1.20x against 1.12x: the running batch steps twice as
# often while prompts are computed; benchmarks/results/gpu-serving-h200.md). 0.1 s
# holds ~4-8k prompt tokens there, the order of vLLM's 8192-token budget.
AUTO_TARGET_MIN_S = 0.1
# Fewest prompt tokens a step that prefills carries: a prompt goes on even when the
# rows alone take the whole target.
MIN_TOKENS = 32


class PrefillBudget:
    """The prompt-token budget of the next step that prefills.

    Args:
        target_s: The step time to aim for while requests decode, seconds; None: the
            automatic target, ``max(AUTO_TARGET_DECODE_STEPS × the decode step,
            AUTO_TARGET_MIN_S)``.
    """

    def __init__(self, target_s: float | None = None) -> None:
        self.target_s = target_s
        self.decode_s: float | None = None  # a decode step (the rows alone), seconds
        # NOTE: the cost per prompt token is the ratio of two running sums (seconds
        # over tokens), so that a step of many tokens weighs more than one of a few
        self._cost_s = 0.0
        self._cost_tokens = 0.0

    @property
    def per_token_s(self) -> float | None:
        """Measured seconds per prompt token, or None before any step prefilled."""
        return self._cost_s / self._cost_tokens if self._cost_tokens > 0 else None

    def target(self) -> float | None:
        """The step time aimed at while requests decode, seconds (None: no decode step
        measured yet and no ``target_s``)."""
        if self.target_s is not None:
            return self.target_s
        if self.decode_s is None:
            return None
        return max(AUTO_TARGET_DECODE_STEPS * self.decode_s, AUTO_TARGET_MIN_S)

    def observe(self, prompt_tokens: int, forward_s: float) -> None:
        """Record a step's forward time (seconds) and the prompt tokens it computed (0:
        a decode step)."""
        if prompt_tokens == 0:
            self.decode_s = forward_s if self.decode_s is None else (
                (1 - DECAY) * self.decode_s + DECAY * forward_s)
            return
        # what the prompt tokens added to the step (a prefill alone still pays what a
        # decode step pays: reading the weights, launching the kernels)
        added = max(forward_s - (self.decode_s or 0.0), 0.0)
        self._cost_s = (1 - DECAY) * self._cost_s + DECAY * added
        self._cost_tokens = (1 - DECAY) * self._cost_tokens + DECAY * prompt_tokens

    def tokens(self, max_tokens: int, decoding: bool) -> int:
        """The budget of the next step that prefills: ``max_tokens`` (the most of one
        step, ``--max-batch-prefill-tokens``) when nothing decodes or no prompt cost is
        measured yet; 0 while requests decode and no decode step is measured, with the
        automatic target (which is a number of decode steps: a step of the rows alone
        measures one); else the tokens whose measured cost, added to a decode step,
        fits the target (at least ``MIN_TOKENS``).

        NOTE: without that 0, a burst of arrivals never leaves room for a decode step of
        its own (every step also prefills) and the automatic target stays unknown
        through the whole burst: every step then took all of ``max_tokens`` (on an
        H100, bench.py's workload at 1.05x nano-vllm against 1.24x with the target
        set; benchmarks/results/gpu-serving-h200.md)."""
        if decoding and self.target_s is None and self.decode_s is None:
            return 0
        target, per_token = self.target(), self.per_token_s
        if not decoding or target is None or not per_token:
            return max_tokens
        spare = target - (self.decode_s or 0.0)
        # NOTE: compared before dividing: an infinite target, or a cost per token
        # decayed to a subnormal, makes the quotient inf, which int() refuses
        if spare >= per_token * max_tokens:
            return max_tokens
        fit = int(spare / per_token)
        return max(fit, min(MIN_TOKENS, max_tokens))
