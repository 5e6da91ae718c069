"""How the OpenAI routes read a request: their sampling fields in /generate's terms,
the checks of ``model``, ``n`` / ``best_of`` and ``top_logprobs``, OpenAI's field names
in errors, and the ``finish_reason`` and ``usage`` of an answer.

Source: the OpenAI API reference (completions and chat completions).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from router.api.generation import Completion
from router.api.openai_schemas import SamplingFields, Usage, unsupported_field
from router.api.openai_tools import RESPONSE_SCHEMA_FIELD
from router.api.state import ServerState
from router.parameters import GenerateParameters
from router.request import Finish, FinishReason
from router.validation import RequestValidationError, Validator, parameters_from

# Chat requests without max_tokens generate at most this many tokens.
DEFAULT_CHAT_MAX_TOKENS = 100
# The shared validator speaks /generate's names; errors of the OpenAI routes use these.
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "top_n_tokens": "logprobs",
                    "decoder_input_details": "echo", "inputs": "prompt",
                    "grammar.value": RESPONSE_SCHEMA_FIELD}


class ModelNotFoundError(LookupError):
    """The request's ``model`` is none of the served names (HTTP 404, as vLLM)."""

    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        self.model = model
        super().__init__(
            f"The model `{model}` does not exist; this server serves: {', '.join(served)}"
        )


@contextmanager
def openai_field_names(names: dict[str, str]) -> Iterator[None]:
    """Re-raise :class:`RequestValidationError` with OpenAI's field names (``names``:
    /generate name → OpenAI name) in its field and message."""
    try:
        yield
    except RequestValidationError as error:
        raise error.renamed(names) from None


def finish_reason(finish: Finish | None) -> str | None:
    """OpenAI's name: ``length`` or ``stop`` (EOS, stop string or stop token)."""
    if finish is None:
        return None
    return "length" if finish.reason is FinishReason.LENGTH else "stop"


def check_request(body: SamplingFields, state: ServerState) -> None:
    """Refuse unsupported fields (400 naming the field) and unknown models (404)."""
    refused = unsupported_field(body.model_extra or {})
    if refused is not None:
        raise RequestValidationError(*refused)
    if body.model is not None and body.model not in state.model_names:
        raise ModelNotFoundError(body.model, state.model_names)


def sampling_parameters(
    body: SamplingFields, max_tokens: int, top_n: int, prompt_logprobs: bool = False,
    grammar: dict[str, Any] | None = None,
) -> GenerateParameters:
    """An OpenAI request's sampling fields in /generate's terms (temperature 0 = greedy,
    whatever warpers come with it).

    Raises:
        RequestValidationError: a value out of range (named as /generate names it;
            :func:`openai_field_names` renames it).
    """
    temperature = 1.0 if body.temperature is None else body.temperature
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values: dict[str, Any] = {
        "do_sample": temperature > 0.0,
        "temperature": temperature if temperature > 0.0 else None,
        "max_new_tokens": max_tokens,
        "stop": stops,
        "seed": body.seed,
        "top_n_tokens": top_n or None,
        "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos,
        "truncate": body.truncate,
        "decoder_input_details": prompt_logprobs,
        "grammar": grammar,
    }
    for name in ("top_p", "top_k", "min_p", "typical_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty"):
        values[name] = getattr(body, name)
    if temperature <= 0.0:
        # temperature 0 is greedy (argmax), whatever warpers come with it.
        for name in ("top_p", "top_k", "min_p", "typical_p"):
            values[name] = None
    return parameters_from(values)


def usage_of(prompt_tokens: int, completions: list[Completion]) -> Usage:
    """Token counts of one answer (prompt tokens counted once)."""
    generated = sum(c.num_generated for c in completions)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                 total_tokens=prompt_tokens + generated)




def check_n(validator: Validator, body: SamplingFields, best_of: int | None) -> int:
    """The number of sequences to generate per prompt (best_of, else n)."""
    validator.check_n(body.n, "n")
    if best_of is not None:
        validator.check_n(best_of, "best_of")
        if best_of < body.n:
            raise RequestValidationError("best_of", "must be >= n")
        if body.stream and best_of != body.n:
            raise RequestValidationError("best_of", "must equal n when streaming")
    return best_of or body.n


def check_top_n(validator: Validator, value: int, field: str) -> int:
    """``value`` alternatives per token, within ``--max-top-n-tokens``.

    Raises:
        RequestValidationError: more than the limit (naming ``field`` and the flag).
    """
    if value > validator.limits.max_top_n_tokens:
        raise RequestValidationError(
            field, f"must be <= {validator.limits.max_top_n_tokens} (--max-top-n-tokens)"
        )
    return value
