"""Protobuf ↔ typed records (:mod:`shard.records`). No logic beyond field mapping.

Sampling fields whose "off" value is not zero are ``optional`` in the proto: unset, they
take the off value; set, they are taken as they are (greedy decoding is requested with
``do_sample=false``, never with temperature 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from shard.pb import shard_pb2 as pb
from shard.records import (
    CachedRequest,
    DecodeStep,
    Generation,
    NewRequest,
    PrefillStep,
    ShardInfo,
    StepOutput,
)
from shard.sampling_types import SamplingParams


def sampling_from_pb(p: pb.SamplingParameters) -> SamplingParams:
    """The parameters as sent; an unset optional field takes the "off" value of
    :class:`SamplingParams`.

    Raises:
        ValueError: an out-of-range value (naming the field).
    """
    off = SamplingParams()
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else off.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else off.top_p,
        typical_p=p.typical_p if p.HasField("typical_p") else off.typical_p,
        min_p=p.min_p,
        do_sample=p.do_sample,
        seed=p.seed,
        repetition_penalty=(p.repetition_penalty if p.HasField("repetition_penalty")
                            else off.repetition_penalty),
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )


def new_request_from_pb(r: pb.NewRequest) -> NewRequest:
    try:
        sampling = sampling_from_pb(r.sampling)
    except ValueError as exc:
        raise ValueError(f"request {r.id}: sampling: {exc}") from exc
    return NewRequest(
        request_id=r.id,
        input_ids=tuple(r.input_ids),
        cache_len=r.cache_len,
        block_ids=tuple(r.block_ids),
        sampling=sampling,
        num_tokens=r.num_tokens,
        top_n_tokens=r.top_n_tokens,
        prompt_logprobs=r.prompt_logprobs,
        num_generated=r.num_generated,
        grammar=r.grammar,
    )


def cached_request_from_pb(r: pb.CachedRequest) -> CachedRequest:
    return CachedRequest(r.id, tuple(r.new_block_ids), r.num_tokens)


def prefill_step_from_pb(request: pb.PrefillRequest) -> PrefillStep:
    return PrefillStep(
        new_requests=tuple(new_request_from_pb(r) for r in request.new_requests),
        cached_requests=tuple(cached_request_from_pb(r) for r in request.cached_requests),
        finished_request_ids=tuple(request.finished_request_ids),
        decode=request.decode,
        row_appends=tuple(cached_request_from_pb(r) for r in request.row_appends),
    )


def decode_step_from_pb(request: pb.DecodeRequest) -> DecodeStep:
    return DecodeStep(
        cached_requests=tuple(cached_request_from_pb(r) for r in request.cached_requests),
        finished_request_ids=tuple(request.finished_request_ids),
        num_speculative_tokens=request.num_speculative_tokens,
    )


def generation_to_pb(g: Generation) -> pb.Generation:
    return pb.Generation(
        request_id=g.request_id,
        token_id=g.token_id,
        logprob=g.logprob,
        top_tokens=[pb.TopToken(token_id=t.token_id, logprob=t.logprob) for t in g.top_tokens],
        prompt_logprobs=list(g.prompt_logprobs),
    )


def timings_to_pb(forward_ns: int, total_ns: int) -> pb.Timings:
    return pb.Timings(forward_ns=forward_ns, total_ns=total_ns)


def grammar_failures_to_pb(out: StepOutput) -> list[pb.GrammarFailure]:
    return [pb.GrammarFailure(request_id=rid, message=message)
            for rid, message in out.grammar_failures]


def decode_response_to_pb(out: StepOutput, total_ns: int) -> pb.DecodeResponse:
    """Tokens and logprobs as packed arrays in row order; a ``Generation`` message
    only for the requests with top tokens (a step of hundreds of requests stays a few
    kilobytes and parses without a message per request)."""
    response = _rows_to_pb(out.generations)
    response.num_tokens.extend(out.num_tokens)
    response.num_proposed.extend(out.num_proposed)
    response.timings.CopyFrom(timings_to_pb(out.forward_ns, total_ns))
    response.timings.propose_ns = out.propose_ns
    response.grammar_failures.extend(grammar_failures_to_pb(out))
    return response


def prefill_response_to_pb(out: StepOutput, total_ns: int, decode: bool) -> pb.PrefillResponse:
    """A Prefill's first tokens as ``Generation`` messages; with ``decode`` (a mixed
    step) the rows' tokens too, packed as a Decode answers them."""
    response = pb.PrefillResponse(
        generations=[generation_to_pb(g) for g in out.prompt_generations],
        timings=timings_to_pb(out.forward_ns, total_ns),
        grammar_failures=grammar_failures_to_pb(out),
    )
    if decode:
        response.decode.CopyFrom(_rows_to_pb(out.row_generations))
    return response


def _rows_to_pb(rows: Sequence[Generation]) -> pb.DecodeResponse:
    return pb.DecodeResponse(
        generations=[generation_to_pb(g) for g in rows if g.top_tokens],
        token_ids=[g.token_id for g in rows],
        logprobs=[g.logprob for g in rows],
    )


def info_to_pb(i: ShardInfo) -> pb.InfoResponse:
    return pb.InfoResponse(
        model_id=i.model_id,
        dtype=i.dtype,
        device=i.device,
        rank=i.rank,
        world_size=i.world_size,
        block_size=i.block_size,
        num_blocks=i.num_blocks,
        attention_backend=i.attention_backend,
        attention_backend_reason=i.attention_backend_reason,
        max_position_embeddings=i.max_position_embeddings,
        vocab_size=i.vocab_size,
    )
