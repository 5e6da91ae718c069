"""Request and response bodies of the TGI-compatible HTTP API (pydantic models).

Field meanings follow Hugging Face Text Generation Inference; the "off" value of each
sampling parameter is documented on its field and is the same on every endpoint. JSON
types are strict: ``"5"`` or ``true`` for an integer is a 422 (a JSON integer is fine
for a number).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The generation parameters live outside the API package (validation takes them from
# every endpoint); /generate's body carries them as they are.
from router.parameters import GenerateParameters


class GenerateRequest(BaseModel):
    """Body of ``POST /generate`` and ``POST /generate_stream``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    inputs: str = Field(..., min_length=1, description="The prompt (non-empty).")
    parameters: GenerateParameters = Field(default_factory=lambda: GenerateParameters())
    stream: bool = False


class Token(BaseModel):
    """A generated token; ``logprob`` is under the model's distribution."""

    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class PrefillToken(BaseModel):
    """A prompt token; the first one has no logprob (nothing precedes it)."""

    id: int
    text: str
    logprob: float | None = None


FinishReasonName = Literal["length", "eos_token", "stop_sequence"]


class SequenceDetails(BaseModel):
    """How one generated sequence ended and its tokens (TGI shape)."""

    finish_reason: FinishReasonName
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] = Field(default_factory=list)


class BestOfSequence(SequenceDetails):
    """One of the other ``best_of - 1`` sequences of a best_of request."""

    generated_text: str


class Details(SequenceDetails):
    """``details`` of a /generate response (TGI shape)."""

    best_of_sequences: list[BestOfSequence] | None = None


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
    """TGI error body."""

    error: str
    error_type: str


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    inputs: str = Field(..., description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add BOS/EOS as the model does.")


class TokenInfo(BaseModel):
    """One token of ``/tokenize``: id, text and character offsets ``[start, stop)``."""

    id: int
    text: str
    start: int
    stop: int


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    num_shard: int
    attention_backend: str
    quantization: str = Field(description="Weights: none, or fp8 (--quantization).")
    kv_cache_dtype: str = Field(description="Dtype of the KV cache's keys and values.")
    quantization_details: str = Field(
        description="What is quantized and how, in words; empty when nothing is.")
    speculative_decoding: str = Field(
        "", description="How decode steps speculate, in words; empty when they do not.")
    speculative_proposed_tokens: int = Field(
        0, description="Guesses proposed so far (speculative decoding).")
    speculative_accepted_tokens: int = Field(
        0, description="Guesses accepted so far; over the proposed: the acceptance rate.")
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    prefix_cache_hit_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    version: str
