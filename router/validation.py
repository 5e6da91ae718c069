"""Request validation beyond the schema: limits, tokenization, truncation.

Every failure raises :class:`RequestValidationError` naming the field, which the HTTP
layer turns into a 422 (and the gRPC layer into INVALID_ARGUMENT).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.api.schemas import GenerateParameters
from router.config import SchedulerConfig, ValidationLimits
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer


class RequestValidationError(ValueError):
    """Bad user input; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Validator:
    """Checks requests against the tokenizer, token budgets and parameter limits.

    Attributes:
        kv_capacity_tokens: Tokens the whole KV cache holds; a request needing more can
            never run and is rejected at once.
    """

    tokenizer: Tokenizer
    scheduler: SchedulerConfig
    limits: ValidationLimits
    kv_capacity_tokens: int

    def validate(self, inputs: str, params: GenerateParameters) -> GenerationRequest:
        """Tokenize ``inputs`` and build a :class:`GenerationRequest`.

        Raises:
            RequestValidationError: a limit is exceeded or a value is unsupported.
        """
        if not inputs:
            raise RequestValidationError("inputs", "must not be empty")
        self._check_limits(params)
        input_ids = self.tokenizer.encode(inputs)
        if params.truncate is not None and len(input_ids) > params.truncate:
            input_ids = input_ids[-params.truncate :]
        if not input_ids:
            raise RequestValidationError("inputs", "tokenizes to zero tokens")
        self._check_lengths(len(input_ids), params)
        do_sample = params.do_sample
        return GenerationRequest(
            input_ids=tuple(input_ids),
            sampling=SamplingParams(
                do_sample=do_sample,
                temperature=params.temperature if params.temperature is not None else 1.0,
                top_k=params.top_k if params.top_k is not None and params.top_k > 0 else 0,
                top_p=params.top_p if params.top_p is not None else 1.0,
                typical_p=params.typical_p if params.typical_p is not None else 1.0,
                min_p=params.min_p or 0.0,
                repetition_penalty=params.repetition_penalty or 1.0,
                frequency_penalty=params.frequency_penalty or 0.0,
                presence_penalty=params.presence_penalty or 0.0,
                seed=params.seed or 0,
            ),
            stopping=StoppingParams(
                max_new_tokens=params.max_new_tokens,
                stop_sequences=tuple(params.stop),
                stop_token_ids=tuple(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
            ),
            top_n_tokens=params.top_n_tokens or 0,
            prompt_logprobs=params.decoder_input_details,
        )

    def _check_limits(self, params: GenerateParameters) -> None:
        limits = self.limits
        if len(params.stop) > limits.max_stop_sequences:
            raise RequestValidationError(
                "stop", f"at most {limits.max_stop_sequences} stop sequences (--max-stop-sequences)"
            )
        for stop in params.stop:
            if len(stop) > limits.max_stop_sequence_chars:
                raise RequestValidationError(
                    "stop", f"stop sequences are limited to {limits.max_stop_sequence_chars} chars"
                )
        if (params.top_n_tokens or 0) > limits.max_top_n_tokens:
            raise RequestValidationError(
                "top_n_tokens", f"must be <= {limits.max_top_n_tokens} (--max-top-n-tokens)"
            )
        if (params.best_of or 1) > 1:
            if (params.best_of or 1) > limits.max_best_of:
                raise RequestValidationError(
                    "best_of", f"must be <= {limits.max_best_of} (--max-best-of)"
                )
            raise RequestValidationError("best_of", "values above 1 are not supported yet")
        vocab = self.tokenizer.vocab_size
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < vocab:
                raise RequestValidationError("stop_token_ids", f"{token_id} not in [0, {vocab})")

    def _check_lengths(self, num_input: int, params: GenerateParameters) -> None:
        budgets = self.scheduler
        if num_input > budgets.max_input_tokens:
            raise RequestValidationError(
                "inputs",
                f"{num_input} tokens, more than max_input_tokens={budgets.max_input_tokens}; "
                "pass `truncate` to keep only the last tokens",
            )
        total = num_input + params.max_new_tokens
        if total > budgets.max_total_tokens:
            raise RequestValidationError(
                "max_new_tokens",
                f"inputs tokens + max_new_tokens must be <= max_total_tokens="
                f"{budgets.max_total_tokens}; given {num_input} input tokens and "
                f"{params.max_new_tokens} max_new_tokens",
            )
        if total > self.kv_capacity_tokens:
            raise RequestValidationError(
                "max_new_tokens",
                f"{num_input} input tokens + {params.max_new_tokens} max_new_tokens exceed the "
                f"KV cache ({self.kv_capacity_tokens} tokens)",
            )
