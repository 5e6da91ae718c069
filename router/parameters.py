"""Generation parameters: the one form every endpoint (TGI, OpenAI, public gRPC) puts a
request's parameters in before :mod:`router.validation` checks them.

Field meanings follow Hugging Face Text Generation Inference, whose ``/generate`` body
carries them as they are; the "off" value of each sampling parameter is documented on
its field and is the same on every endpoint. JSON types are strict: ``"5"`` or ``true``
for an integer is refused (a JSON integer is fine for a number).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Seeds are uint64 end to end: the public gRPC ``Parameters.seed``, the shards'
# ``SamplingParameters.seed``, and shard/sampling.py's row_seed, which mixes all 64 bits.
MAX_SEED = 2**64 - 1
# NOTE: sampling parameters travel to the shards as float32; these bounds keep every
# accepted value finite and non-zero there (a penalty of 1e-300 would become 0.0).
MIN_PENALTY, MAX_PENALTY = 1e-3, 1e3
MAX_TEMPERATURE = 100.0


class GrammarParameters(BaseModel):
    """``parameters.grammar``: the output must follow a grammar (TGI's field). Every
    generated token is masked by it on the shards, so the output is guaranteed to match
    (unless ``max_new_tokens`` or a stop sequence cuts it short); a complete grammar
    ends the request with EOS."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json", "regex"] = Field(
        ..., description="`json`: value is a JSON schema; `regex`: value is a regular "
        "expression the whole output fully matches."
    )
    value: Any = Field(
        ..., description="A JSON schema (object, or its JSON text) for `json`; a regex "
        "string for `regex` (Rust regex syntax: no look-around, no backreferences)."
    )
    strict: bool = Field(
        True, description="`json` only: refuse schema keywords the grammar cannot enforce "
        "(false ignores them)."
    )


class GenerateParameters(BaseModel):
    """Generation parameters of ``/generate`` and ``/generate_stream`` (and, converted,
    of every other endpoint). Source: TGI's ``GenerateParameters``.

    Sampling is on when ``do_sample`` is true or any warper is active (temperature != 1,
    top_k > 0, top_p < 1, typical_p < 1, min_p > 0) — TGI's rule. A temperature below
    1e-4 means greedy. Logprobs are always those of the model's distribution: before
    penalties, temperature and truncation (see shard/sampling.py).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    do_sample: bool = Field(False, description="Sample; false = greedy (argmax).")
    max_new_tokens: int = Field(
        100, ge=1, description="Most tokens to generate (>= 1; 0 is a 422)."
    )
    temperature: float | None = Field(
        None, gt=0.0, le=MAX_TEMPERATURE,
        description="Divide logits by this, in (0, 100]; null or 1.0 = unchanged.",
    )
    top_k: int | None = Field(
        None, ge=-1, description="Keep the k most likely tokens; null, 0 or -1 = off."
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1]; 1.0 or null = off."
    )
    typical_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Typical sampling mass in (0, 1]; 1.0 or null = off."
    )
    min_p: float | None = Field(
        None, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability; 0 = off."
    )
    repetition_penalty: float | None = Field(
        None, ge=MIN_PENALTY, le=MAX_PENALTY,
        description="CTRL/HF penalty over the prompt and generated tokens: positive logits "
        "are divided by it, negative ones multiplied; in [0.001, 1000]; 1.0 = off.",
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0,
        description="OpenAI: subtract this x (count of the token among generated tokens).",
    )
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0,
        description="OpenAI: subtract this once from every token generated at least once.",
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED,
        description="Random seed of sampling; the same seed gives the same text whatever "
        "else is in the batch. With best_of/n > 1, sequence i uses seed + i.",
    )
    stop: list[str] = Field(
        default_factory=list, description="Stop sequences; /generate's text ends with the one "
        "that matched (TGI), the OpenAI endpoints leave it out.",
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    truncate: int | None = Field(
        None, ge=1, description="Keep only the last `truncate` prompt tokens."
    )
    return_full_text: bool = Field(False, description="Prepend the prompt to the text.")
    details: bool = Field(False, description="Return tokens, logprobs and finish reason.")
    decoder_input_details: bool = Field(False, description="Return prompt tokens.")
    top_n_tokens: int | None = Field(None, ge=0, description="Alternatives per token.")
    best_of: int | None = Field(
        None, ge=1, description="Sample this many sequences and return the one with the "
        "highest total logprob (others in details.best_of_sequences); needs sampling.",
    )
    watermark: bool = Field(False, description="Accepted for compatibility; must be false.")
    grammar: GrammarParameters | None = Field(
        None, description="Constrain the output to a JSON schema or a regex (see "
        "GrammarParameters); null = free text."
    )

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stops: list[str]) -> list[str]:
        if any(stop == "" for stop in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, watermark: bool) -> bool:
        if watermark:
            raise ValueError("watermarking is not supported")
        return watermark
