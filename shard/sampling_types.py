"""What the sampler takes and gives, in the one form the router (validation, requests,
token events) and the shard (records, the sampler) both use: a request's sampling
parameters and an alternative token. Torch-free, so the router can import it (see
tests/unit/router/test_contract.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters ("off" values are the defaults).

    Raises:
        ValueError: a value out of its range (the router validates requests first, so
            this guards the shard's inputs).

    Attributes:
        temperature: divides the logits before softmax; 1.0 = unchanged, < 1 sharper.
            Must be > 0 (greedy is ``do_sample=False``).
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text
            Degeneration"): keep the smallest set of most likely tokens whose
            probability mass reaches top_p; 1.0 = off.
        typical_p: locally typical sampling (Meister et al. 2022, "Locally Typical
            Sampling"): keep tokens whose surprisal is closest to the entropy until
            their mass reaches typical_p; 1.0 = off.
        min_p: min-p sampling (Nguyen et al. 2024, "Turning Up the Heat: Min-p
            Sampling"): drop tokens with probability < min_p × max probability; 0.0 = off.
        do_sample: False = greedy argmax (after penalties); True = sample.
        seed: per-request seed; the step index is mixed in (see
            :func:`shard.sampling.row_seed`); the API layer assigns one to every
            sampling request.
        repetition_penalty: HF/CTRL penalty over prompt + generated tokens; 1.0 = off.
        frequency_penalty: OpenAI: subtract penalty × count of the token among
            generated tokens; 0.0 = off.
        presence_penalty: OpenAI: subtract penalty once if the token was generated;
            0.0 = off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass(frozen=True)
class TopToken:
    """One alternative token: id and logprob (natural log) under the model's
    distribution (before penalties, temperature and truncation)."""

    token_id: int
    logprob: float
