"""Request and response bodies of the TGI-compatible HTTP API (pydantic models).

Field meanings follow Hugging Face Text Generation Inference; the "off" value of each
sampling parameter is documented on its field and is the same on every endpoint.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**63 - 1


class GenerateParameters(BaseModel):
    """Generation parameters of ``/generate`` and ``/generate_stream``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    do_sample: bool = Field(False, description="Sample; false = greedy (argmax).")
    max_new_tokens: int = Field(100, ge=1, description="Most tokens to generate (>= 1).")
    temperature: float | None = Field(
        None, gt=0.0, description="Divide logits by this (> 0); null or 1.0 = unchanged."
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
        None, gt=0.0, description="Penalty (> 0) on prompt and generated tokens; 1.0 = off."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Subtract this x count of each generated token."
    )
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Subtract this from every token generated once."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Random seed of sampling.")
    stop: list[str] = Field(default_factory=list, description="Stop sequences.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    truncate: int | None = Field(
        None, ge=1, description="Keep only the last `truncate` prompt tokens."
    )
    return_full_text: bool = Field(False, description="Prepend the prompt to the text.")
    details: bool = Field(False, description="Return tokens, logprobs and finish reason.")
    decoder_input_details: bool = Field(False, description="Return prompt tokens.")
    top_n_tokens: int | None = Field(None, ge=0, description="Alternatives per token.")
    best_of: int | None = Field(None, ge=1, description="Sequences to generate, best returned.")
    watermark: bool = Field(False, description="Accepted for compatibility; must be false.")

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


class GenerateRequest(BaseModel):
    """Body of ``POST /generate`` and ``POST /generate_stream``."""

    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(..., min_length=1, description="The prompt (non-empty).")
    parameters: GenerateParameters = Field(default_factory=lambda: GenerateParameters())
    stream: bool = False


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


FinishReasonName = Literal["length", "eos_token", "stop_sequence"]


class Details(BaseModel):
    finish_reason: FinishReasonName
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReasonName
    generated_tokens: int
    seed: int | None = None


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    num_shard: int
    attention_backend: str
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    version: str
