"""Typed, torch-free request and result records exchanged between the servicer and the
model runner (the servicer converts them to and from protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shard.sampling_types import SamplingParams, TopToken


@dataclass(frozen=True)
class RequestInput:
    """One request of a Prefill (see ``Request`` in proto/shard.proto).

    Attributes:
        request_id: router-assigned id, unique within the batch.
        input_ids: all tokens so far (prompt, plus generated ones after a preemption).
        cache_len: leading tokens of input_ids already in the KV cache; only
            ``input_ids[cache_len:]`` are computed. Must be < len(input_ids).
        block_ids: the request's block table, enough blocks for len(input_ids) tokens.
        sampling: sampling parameters. (The request's stopping parameters are not read:
            the router decides when a request stops.)
        partial: intermediate chunk of a chunked prefill: write K/V only, sample
            nothing, keep no state.
        top_n_tokens: alternatives to return with each generated token.
        prompt_logprobs: return the logprob of every computed prompt token after the
            first (aligned with ``input_ids[max(cache_len, 1):]``). A partial chunk
            returns no Generation, so with chunked prefill only the final chunk's
            prompt logprobs come back.
        num_generated: how many trailing tokens of input_ids were generated (penalties,
            and the grammar's state after a recompute).
        grammar: llguidance grammar (JSON text) the generated tokens must follow; ""
            = unconstrained (see :mod:`shard.grammar`).
    """

    request_id: int
    input_ids: tuple[int, ...]
    cache_len: int
    block_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    partial: bool = False
    top_n_tokens: int = 0
    prompt_logprobs: bool = False
    num_generated: int = 0
    grammar: str = ""


@dataclass(frozen=True)
class PrefillBatch:
    """A Prefill call: a new batch id and its requests."""

    batch_id: int
    requests: tuple[RequestInput, ...]


class Generation(NamedTuple):
    """The token generated for one request in one step (a named tuple: a decode step
    makes one per request, and a tuple is built several times faster than a frozen
    dataclass).

    Attributes:
        request_id: the request.
        token_id: sampled token.
        logprob: its log-probability under the raw model distribution.
        top_tokens: the ``top_n_tokens`` most likely tokens, most likely first.
        prompt_logprobs: see :attr:`RequestInput.prompt_logprobs` (empty otherwise).
    """

    request_id: int
    token_id: int
    logprob: float
    top_tokens: tuple[TopToken, ...] = ()
    prompt_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class CachedBatchInfo:
    """A batch held by the shard: its id and request ids in order."""

    batch_id: int
    request_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepOutput:
    """Result of Prefill or Decode.

    Attributes:
        generations: one per sampled request, in batch order.
        batch: the batch now cached (empty request_ids when nothing was kept).
        forward_ns: model forward + sampling time on this rank, in nanoseconds.
        grammar_failures: (request id, why) of each request of the step whose grammar
            is in its failed state (see :class:`shard.grammar.GrammarMatcher`): its
            token of this step is void.
    """

    generations: tuple[Generation, ...]
    batch: CachedBatchInfo
    forward_ns: int
    grammar_failures: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class ShardInfo:
    """Static facts reported by ``Info`` (see ``InfoResponse`` in proto/shard.proto)."""

    model_id: str
    dtype: str
    device: str
    rank: int
    world_size: int
    block_size: int
    num_blocks: int
    attention_backend: str
    attention_backend_reason: str
    max_position_embeddings: int
    vocab_size: int
