"""Grammars of constrained generation: JSON schemas and regexes, checked at the router.

A constrained request reaches the shards as an llguidance grammar (JSON text; see
shard/grammar.py, which masks the logits with it). Here a JSON schema or a regex becomes
that grammar and is compiled once against the model's tokenizer, so a bad schema, a bad
regex or a grammar too complex to compile is a 4xx naming the field before anything
reaches a shard. llguidance needs no torch, so the router can do this itself.

JSON output is compact with one space after ``,`` and ``:`` (as ``json.dumps``): no
free whitespace, so a model cannot spin in newlines and every output parses.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from typing import Any

import jsonschema
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from router.tokenizer import Tokenizer

# Seconds one grammar may take to compile before its request is refused.
COMPILE_TIMEOUT_S = 10.0
# Grammars known to compile, kept by text (least recently used dropped first).
CHECKED_CACHE_SIZE = 1024
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The schema or regex is invalid, or its grammar does not compile in time."""


def check_json_schema(schema: Any) -> dict[str, Any]:
    """``schema`` (an object, or its JSON text) as a dict, checked against its JSON
    Schema meta-schema (draft from ``$schema``, 2020-12 by default).

    Raises:
        GrammarError: not JSON, not an object, or not a valid schema.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GrammarError(f"is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise GrammarError("must be a JSON schema (a JSON object)")
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise GrammarError(
            f"is not a valid JSON schema: {error.message}" + (f" (at /{where})" if where else "")
        ) from None
    return schema


def json_schema_grammar(schema: Any, strict: bool = True) -> str:
    """The grammar of JSON documents that validate against ``schema``.

    Args:
        schema: a JSON schema (dict or JSON text).
        strict: refuse keywords the grammar cannot enforce (for example an unknown
            ``format``); False ignores them (the output still follows the rest).

    Raises:
        GrammarError: see :func:`check_json_schema`.
    """
    checked = check_json_schema(schema)
    options = {**JSON_OPTIONS, "lenient": not strict}
    return LLMatcher.grammar_from_json_schema(checked, overrides=options)  # type: ignore[arg-type]


def regex_grammar(pattern: Any) -> str:
    """The grammar of strings that fully match ``pattern`` (Rust ``regex`` syntax,
    close to Python's without look-around and backreferences).

    Raises:
        GrammarError: not a non-empty string (its syntax is checked by
            :meth:`GrammarChecker.check`).
    """
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("must be a non-empty regular expression string")
    return LLMatcher.grammar_from_regex(pattern)


class GrammarChecker:
    """Compiles grammars against the model's tokenizer with a time limit.

    Args:
        tokenizer: the model's tokenizer (its ``tokenizer.json`` and EOS ids).
        timeout_s: longest compile, seconds.
    """

    def __init__(self, tokenizer: Tokenizer, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._lltokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, None] = OrderedDict()
        # NOTE: a compile that overruns keeps its thread until llguidance's fuel limits
        # stop it; two threads leave room for one more while that happens.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    @property
    def lltokenizer(self) -> LLTokenizer:
        """The tokenizer in llguidance's form (built once, about 0.3 s)."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    eos_token=sorted(self.tokenizer.eos_token_ids) or None,
                )
            return self._lltokenizer

    def check(self, grammar: str) -> None:
        """Compile ``grammar`` (blocking; call off the event loop).

        Raises:
            GrammarError: it does not compile (the message says why), or compiling
                took longer than ``timeout_s``.
        """
        with self._lock:
            if grammar in self._checked:
                self._checked.move_to_end(grammar)
                return
        future = self._pool.submit(_compile, grammar, self.lltokenizer)
        try:
            error = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(
                f"the grammar did not compile within {self.timeout_s:g} s; simplify it"
            ) from None
        if error:
            raise GrammarError(_first_line(error))
        with self._lock:
            self._checked[grammar] = None
            if len(self._checked) > CHECKED_CACHE_SIZE:
                self._checked.popitem(last=False)


def _compile(grammar: str, tokenizer: LLTokenizer) -> str:
    """Why ``grammar`` cannot constrain generation ("" when it can): it does not
    compile, or it allows no first token (nothing can satisfy it, as a regex of an
    empty character class or a schema that only refers to itself)."""
    limits = LLParserLimits(verbose_errors=False)
    error = LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        return error
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    matcher.compute_bitmask()
    if matcher.is_error():
        return f"no output can satisfy it ({_first_line(matcher.get_error())})"
    return ""


def _first_line(message: str) -> str:
    """llguidance's message without the echo of the grammar it appends."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else "invalid grammar"
    for line in lines[1:]:
        if line.startswith("error:"):
            return f"{head} {line.removeprefix('error:').strip()}"
    return head
