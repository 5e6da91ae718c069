"""Typed, torch-free request and result records exchanged between the servicer and the
model runner (the servicer converts them to and from protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shard.sampling_types import SamplingParams, TopToken


@dataclass(frozen=True)
class NewRequest:
    """A request the shard has not seen, sent once in full (see ``NewRequest`` in
    proto/shard.proto).

    Attributes:
        request_id: router-assigned id, not held by the shard yet.
        input_ids: all tokens so far (prompt, plus generated ones after a preemption).
        cache_len: leading tokens of input_ids already in the KV cache (a prefix cache
            hit); computing starts there. Must be < len(input_ids).
        block_ids: the request's block table, enough blocks for len(input_ids) tokens.
        sampling: sampling parameters. (The request's stopping parameters are not read:
            the router decides when a request stops.)
        num_tokens: tokens to compute in this step from ``cache_len``; 0 = all the rest.
            A chunk that ends before input_ids does samples nothing: the shard keeps the
            request and later Prefills continue it (:class:`CachedRequest`).
        top_n_tokens: alternatives to return with each generated token.
        prompt_logprobs: return the logprob of every computed prompt token after the
            first (aligned with ``input_ids[max(cache_len, 1):]``); such a request
            comes whole, never in chunks.
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
    num_tokens: int = 0
    top_n_tokens: int = 0
    prompt_logprobs: bool = False
    num_generated: int = 0
    grammar: str = ""

    @property
    def end(self) -> int:
        """Tokens of input_ids in the cache once this step has run."""
        if self.num_tokens == 0:
            return len(self.input_ids)
        return min(self.cache_len + self.num_tokens, len(self.input_ids))

    @property
    def partial(self) -> bool:
        """This step computes a chunk that ends before the prompt does."""
        return self.end < len(self.input_ids)


@dataclass(frozen=True)
class CachedRequest:
    """A request the shard holds, as it changes in one step (see ``CachedRequest`` in
    proto/shard.proto).

    Attributes:
        request_id: the request.
        new_block_ids: KV blocks appended to its block table before the step.
        num_tokens: tokens to compute in this step; 0 = the default (a Prefill: the
            rest of the prompt; a Decode: 1).
    """

    request_id: int
    new_block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


@dataclass(frozen=True)
class PrefillStep:
    """A Prefill call: requests that leave, then the next chunks of requests being
    prefilled (``cached_requests``), then new requests, computed in that order.

    With ``decode`` (a mixed step) every decoding row held also computes one token in
    the same forward, after the block appends of ``row_appends``, as a
    :class:`DecodeStep` would."""

    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] = ()
    finished_request_ids: tuple[int, ...] = ()
    decode: bool = False
    row_appends: tuple[CachedRequest, ...] = ()


@dataclass(frozen=True)
class DecodeStep:
    """A Decode call: requests that leave, and rows whose block table grows; every row
    held then decodes one token, or with ``num_speculative_tokens`` k > 0 verifies up to
    k guesses of the shard's proposer and emits 1 to 1 + k tokens (a cached request's
    ``num_tokens`` bounds its row's 1 + guesses)."""

    cached_requests: tuple[CachedRequest, ...] = ()
    finished_request_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 0


class Generation(NamedTuple):
    """The token generated for one request in one step (a named tuple: a decode step
    makes one per request, and a tuple is built several times faster than a frozen
    dataclass).

    Attributes:
        request_id: the request.
        token_id: sampled token.
        logprob: its log-probability under the raw model distribution.
        top_tokens: the ``top_n_tokens`` most likely tokens, most likely first.
        prompt_logprobs: see :attr:`NewRequest.prompt_logprobs` (empty otherwise).
    """

    request_id: int
    token_id: int
    logprob: float
    top_tokens: tuple[TopToken, ...] = ()
    prompt_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """Result of Prefill or Decode.

    Attributes:
        generations: one per sampled request: a Prefill's in its requests' order, a
            Decode's in row order.
        forward_ns: model forward + sampling time on this rank, in nanoseconds.
        grammar_failures: (request id, why) of each request of the step whose grammar
            is in its failed state (see :class:`shard.grammar.GrammarMatcher`): its
            token of this step is void.
        num_rows: a mixed step's decoding rows: the first ``num_rows`` generations,
            in row order, come before the prompts' (0 for any other step).
        num_tokens: a speculative Decode's generations per row, in row order (its
            generations are each row's tokens in order, row after row); empty for any
            other step (one generation per row).
        num_proposed: a speculative Decode's guesses proposed per row, in row order.
        propose_ns: a speculative Decode's time to propose its guesses, nanoseconds
            (part of ``forward_ns``).
    """

    generations: tuple[Generation, ...]
    forward_ns: int
    grammar_failures: tuple[tuple[int, str], ...] = ()
    num_rows: int = 0
    num_tokens: tuple[int, ...] = ()
    num_proposed: tuple[int, ...] = ()
    propose_ns: int = 0

    @property
    def row_generations(self) -> tuple[Generation, ...]:
        """A mixed step's decoding rows, in row order (the first ``num_rows``)."""
        return self.generations[: self.num_rows]

    @property
    def prompt_generations(self) -> tuple[Generation, ...]:
        """A Prefill's first tokens of the prompts it completed (after the rows)."""
        return self.generations[self.num_rows :]


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
