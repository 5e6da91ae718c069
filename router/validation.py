"""Request validation beyond the schema: limits, tokenization, truncation, seeds.

Every failure raises :class:`RequestValidationError` naming the field, which the HTTP
layer turns into a 422 (TGI) or 400 (OpenAI) and the gRPC layer into INVALID_ARGUMENT.
All endpoints convert their parameters into :class:`GenerateParameters` first, so each
parameter has one meaning everywhere.

Seeds: every sampling request gets a seed here (the user's, or a random one), which
the API reports back: the same seed reproduces the text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pydantic import ValidationError
from tokenizers import Encoding

from router.config import SchedulerConfig, ValidationLimits
from router.grammar import GrammarChecker, GrammarError, json_schema_grammar, regex_grammar
from router.parameters import MAX_SEED, GenerateParameters, GrammarParameters
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer

# Below this temperature a request is greedy (OpenAI's temperature 0).
GREEDY_TEMPERATURE = 1e-4
# Smallest top_p / typical_p sent to the shards (float32 must not round them to 0).
MIN_MASS = 1e-6


class RequestValidationError(ValueError):
    """Bad user input; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def renamed(self, names: Mapping[str, str]) -> RequestValidationError:
        """The same error in another API's words: ``names`` maps field names (whole
        words, in the field and in the message) to the names to show instead."""
        if not names:
            return self
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        message = pattern.sub(lambda match: names[match.group(1)], self.message)
        return RequestValidationError(names.get(self.field, self.field), message)


def parameters_from(values: dict[str, Any], prefix: str = "") -> GenerateParameters:
    """Build :class:`GenerateParameters` from converted values of another endpoint.

    Raises:
        RequestValidationError: a value is out of range (named by its field).
    """
    try:
        return GenerateParameters.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise RequestValidationError(prefix + field, first.get("msg", "invalid")) from error


def check_text(field: str, text: str) -> None:
    """Reject text that is not valid Unicode (for example a lone surrogate from a
    ``\\ud800`` JSON escape), which the tokenizer cannot encode.

    Raises:
        RequestValidationError: naming ``field``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestValidationError(
            field, f"is not valid Unicode text ({error.reason} at position {error.start})"
        ) from None


def is_sampling(params: GenerateParameters) -> bool:
    """TGI's rule: sample when asked to, or when any warper changes the distribution."""
    if params.temperature is not None and params.temperature < GREEDY_TEMPERATURE:
        return False
    return (
        params.do_sample
        or (params.temperature is not None and params.temperature != 1.0)
        or (params.top_k is not None and params.top_k > 0)
        or (params.top_p is not None and params.top_p < 1.0)
        or (params.typical_p is not None and params.typical_p < 1.0)
        or (params.min_p is not None and params.min_p > 0.0)
    )


def public_seed(request: GenerationRequest) -> int | None:
    """The seed to report for ``request`` (None when it is greedy)."""
    if not request.sampling.do_sample:
        return None
    return request.sampling.seed


def with_seed(request: GenerationRequest, seed: int) -> GenerationRequest:
    """``request`` sampling with seed ``seed``."""
    return replace(request, sampling=replace(request.sampling, seed=seed))


class KvCapacity(Protocol):
    """The KV cache's size (a block manager, or its copy in an API process)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...


class Budgets(Protocol):
    """Where the budgets in force are read: the engine's scheduler, or its copy in an API
    process (updated after each shard-group restart)."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def block_manager(self) -> KvCapacity: ...


@dataclass(frozen=True)
class Validator:
    """Checks requests against the tokenizer, token budgets and parameter limits.

    Attributes:
        scheduler: The engine's scheduler: its budgets and block manager are the ones
            requests are checked against, so the limits a restarted shard group's
            Warmup gives (see ``Engine.replace_shards``) apply to the next request.
        max_request_bytes: ``--max-request-bytes``; no text is longer than this many
            characters, on any entry point.
        grammars: compiles the grammars of constrained requests (one per server).
    """

    tokenizer: Tokenizer
    scheduler: Budgets
    limits: ValidationLimits
    max_request_bytes: int = 1 << 20
    grammars: GrammarChecker = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.grammars is None:
            object.__setattr__(self, "grammars", GrammarChecker(self.tokenizer))
        # a scan of the vocabulary (21 ms for 49k entries), done at start-up rather than
        # in the first request's validation
        _ = self.tokenizer.max_token_chars

    @property
    def budgets(self) -> SchedulerConfig:
        """The token budgets in force (from the last Warmup)."""
        return self.scheduler.config

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds; a request needing more can never run and is
        rejected at once."""
        manager = self.scheduler.block_manager
        return manager.num_blocks * manager.block_size

    def validate(
        self, inputs: str | Sequence[int], params: GenerateParameters,
        add_special_tokens: bool = True, field: str = "inputs",
    ) -> GenerationRequest:
        """Tokenize ``inputs`` (or take its token ids) and build a request.

        Args:
            inputs: Prompt text, or prompt token ids.
            params: Parameters, already schema-validated.
            add_special_tokens: Let the tokenizer add BOS etc. (False for chat prompts
                whose template writes them).
            field: Name of the prompt field in error messages.

        Raises:
            RequestValidationError: a limit is exceeded or a value is unsupported.
        """
        if not inputs:
            raise RequestValidationError(field, "must not be empty")
        self.check_limits(params)
        if isinstance(inputs, str):
            check_text(field, inputs)
            self.check_chars(inputs, field, params.truncate)
            input_ids = self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens)
        else:
            input_ids = list(inputs)
            self._check_ids(input_ids, field)
        if params.truncate is not None and len(input_ids) > params.truncate:
            input_ids = input_ids[-params.truncate :]
        if not input_ids:
            raise RequestValidationError(field, "tokenizes to zero tokens")
        self._check_lengths(len(input_ids), params, field)
        sampling = self._sampling(params)
        grammar = self.grammar(params.grammar)
        return GenerationRequest(
            input_ids=tuple(input_ids),
            sampling=sampling,
            stopping=StoppingParams(
                max_new_tokens=params.max_new_tokens,
                stop_sequences=tuple(params.stop),
                stop_token_ids=tuple(params.stop_token_ids),
                # A constrained request ends at EOS: its grammar allows EOS only once
                # the output is complete, so ignore_eos cannot apply to it.
                ignore_eos=params.ignore_eos and not grammar,
            ),
            top_n_tokens=params.top_n_tokens or 0,
            prompt_logprobs=params.decoder_input_details,
            grammar=grammar,
        )

    def grammar(self, spec: GrammarParameters | None, field: str = "grammar") -> str:
        """The compiled-and-checked grammar text of ``spec`` ("" for None). Blocking
        (compiles; call off the event loop).

        Raises:
            RequestValidationError: naming ``field.value`` (bad schema or regex, or a
                grammar that does not compile in time).
        """
        if spec is None:
            return ""
        try:
            if spec.type == "json":
                text = json_schema_grammar(spec.value, strict=spec.strict)
            else:
                text = regex_grammar(spec.value)
            self.grammars.check(text)
        except GrammarError as error:
            raise RequestValidationError(f"{field}.value", str(error)) from None
        return text

    def tokenize(
        self, text: str, add_special_tokens: bool = True, field: str = "inputs"
    ) -> Encoding:
        """Ids and character offsets of ``text`` (``/tokenize``), after the same text
        checks as a prompt without ``truncate``.

        Raises:
            RequestValidationError: the text is not valid Unicode or is too long.
        """
        check_text(field, text)
        self.check_chars(text, field)
        return self.tokenizer.encoding(text, add_special_tokens=add_special_tokens)

    def fan_out(self, request: GenerationRequest, n: int) -> list[GenerationRequest]:
        """``n`` copies of ``request``; sampled copy i uses user seed ``seed + i``."""
        if not request.sampling.do_sample:
            return [request] * n
        seed = public_seed(request)
        assert seed is not None
        return [with_seed(request, (seed + i) % (MAX_SEED + 1)) for i in range(n)]

    def check_n(self, n: int, field: str) -> None:
        """Reject more than ``--max-best-of`` sequences per request (see also
        :meth:`check_sequences`)."""
        if n < 1:
            raise RequestValidationError(field, "must be >= 1")
        if n > self.limits.max_best_of:
            raise RequestValidationError(
                field, f"must be <= {self.limits.max_best_of} (--max-best-of)"
            )
        self.check_sequences(n, field)

    def check_sequences(self, count: int, field: str) -> None:
        """Reject a request of more sequences than ``--max-concurrent-requests``: they
        are admitted together, so it could never run (a 429 would invite a retry that
        always fails).

        Raises:
            RequestValidationError: naming ``field``.
        """
        most = self.scheduler.config.max_concurrent_requests
        if count > most:
            raise RequestValidationError(
                field, f"{count} sequences in one request, more than the server ever runs "
                f"at once ({most}, --max-concurrent-requests)")

    def check_limits(self, params: GenerateParameters) -> None:
        """Limits of ``--max-stop-sequences``, ``--max-top-n-tokens``, ``--max-best-of``
        and the vocabulary.

        Raises:
            RequestValidationError: a limit is exceeded.
        """
        limits = self.limits
        if len(params.stop) > limits.max_stop_sequences:
            raise RequestValidationError(
                "stop", f"at most {limits.max_stop_sequences} stop sequences (--max-stop-sequences)"
            )
        for i, stop in enumerate(params.stop):
            if len(stop) > limits.max_stop_sequence_chars:
                raise RequestValidationError(
                    "stop", f"stop sequences are limited to {limits.max_stop_sequence_chars} chars"
                )
            check_text(f"stop[{i}]", stop)  # generated text never holds a lone surrogate
        if (params.top_n_tokens or 0) > limits.max_top_n_tokens:
            raise RequestValidationError(
                "top_n_tokens", f"must be <= {limits.max_top_n_tokens} (--max-top-n-tokens)"
            )
        best_of = params.best_of or 1
        if best_of > 1:
            self.check_n(best_of, "best_of")
            if not is_sampling(params):
                raise RequestValidationError("best_of", "best_of > 1 needs sampling (do_sample)")
        self._check_ids(params.stop_token_ids, "stop_token_ids")

    def check_chars(self, text: str, field: str, truncate: int | None = None) -> None:
        """Reject, without tokenizing, text longer than any acceptable prompt.

        Every text is at most ``--max-request-bytes`` characters (a UTF-8 character is
        at least one byte, so this is the body limit, applied also where no HTTP body
        is counted). Unless ``truncate`` keeps only the last tokens, text is also at
        most ``max_input_tokens × max_token_chars`` characters: no token covers more
        than ``max_token_chars`` characters, so longer text surely has too many tokens.
        (Keeps huge inputs from costing seconds of tokenizer time.)

        Raises:
            RequestValidationError: naming ``field``.
        """
        if len(text) > self.max_request_bytes:
            raise RequestValidationError(
                field,
                f"{len(text)} characters is more than --max-request-bytes="
                f"{self.max_request_bytes} allows",
            )
        if truncate is not None:
            return
        max_input_tokens = self.budgets.max_input_tokens
        limit = max_input_tokens * self.tokenizer.max_token_chars
        if len(text) > limit:
            raise RequestValidationError(
                field,
                f"{len(text)} characters is more than max_input_tokens="
                f"{max_input_tokens} (--max-input-tokens) tokens can hold; pass `truncate` to "
                "keep only the last tokens",
            )

    def _check_ids(self, ids: Sequence[int], field: str) -> None:
        vocab = self.tokenizer.vocab_size
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise RequestValidationError(field, f"token id {token_id} not in [0, {vocab})")

    def _sampling(self, params: GenerateParameters) -> SamplingParams:
        do_sample = is_sampling(params)
        seed = 0
        if do_sample:
            seed = params.seed if params.seed is not None else random.getrandbits(62)
        temperature = params.temperature if params.temperature is not None else 1.0
        return SamplingParams(
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_k=min(params.top_k, self.tokenizer.vocab_size)
            if params.top_k is not None and params.top_k > 0 else 0,
            top_p=max(params.top_p, MIN_MASS) if params.top_p is not None else 1.0,
            typical_p=max(params.typical_p, MIN_MASS) if params.typical_p is not None else 1.0,
            min_p=params.min_p or 0.0,
            repetition_penalty=params.repetition_penalty or 1.0,
            frequency_penalty=params.frequency_penalty or 0.0,
            presence_penalty=params.presence_penalty or 0.0,
            seed=seed,
        )

    def _check_lengths(self, num_input: int, params: GenerateParameters, field: str) -> None:
        budgets = self.budgets
        capacity = self.kv_capacity_tokens
        if num_input > budgets.max_input_tokens:
            raise RequestValidationError(
                field,
                f"{num_input} tokens, more than max_input_tokens={budgets.max_input_tokens} "
                "(--max-input-tokens); pass `truncate` to keep only the last tokens",
            )
        if params.decoder_input_details and num_input > budgets.max_batch_prefill_tokens:
            raise RequestValidationError(
                "decoder_input_details",
                f"prompt logprobs need the prompt prefilled in one step: {num_input} tokens is "
                f"more than max_batch_prefill_tokens={budgets.max_batch_prefill_tokens} "
                "(--max-batch-prefill-tokens)",
            )
        total = num_input + params.max_new_tokens
        if total > budgets.max_total_tokens:
            raise RequestValidationError(
                "max_new_tokens",
                f"prompt tokens + max_new_tokens must be <= max_total_tokens="
                f"{budgets.max_total_tokens} (--max-total-tokens); given {num_input} prompt "
                "tokens and "
                f"{params.max_new_tokens} max_new_tokens",
            )
        if total > capacity:
            raise RequestValidationError(
                "max_new_tokens",
                f"{num_input} input tokens + {params.max_new_tokens} max_new_tokens exceed the "
                f"KV cache ({capacity} tokens)",
            )
