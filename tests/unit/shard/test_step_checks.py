"""Step checks against the requests held: each inconsistent Prefill or Decode is a
ValueError naming the request and field, raised before anything changes."""

from __future__ import annotations

import pytest
import torch

from shard.records import CachedRequest, DecodeStep, NewRequest, PrefillStep
from shard.requests import RequestState, RequestTable
from shard.sampling_types import SamplingParams
from shard.step_checks import validate_decode, validate_prefill

BLOCK_SIZE, NUM_BLOCKS, VOCAB = 4, 64, 256


def new(rid: int, n: int = 6, blocks: tuple[int, ...] = (0, 1), **kw: object) -> NewRequest:
    return NewRequest(rid, tuple(range(3, 3 + n)), 0, blocks, SamplingParams(), **kw)  # type: ignore[arg-type]


def table() -> RequestTable:
    """Request 1 decodes (seq_len 7, blocks for 8 tokens); request 2 is half prefilled
    (5 of 10 tokens, blocks for 12)."""
    t = RequestTable()
    decoding = RequestState(1, [10, 11], list(range(3, 11)), 7, 1, SamplingParams())
    t.add(decoding)
    t.join([decoding], torch.tensor([10]), torch.device("cpu"))
    t.add(RequestState(2, [20, 21, 22], list(range(3, 13)), 5, 0, SamplingParams()))
    return t


def prefill_error(step: PrefillStep) -> str:
    with pytest.raises(ValueError) as error:
        validate_prefill(step, table(), BLOCK_SIZE, NUM_BLOCKS, VOCAB)
    return str(error.value)


def decode_error(step: DecodeStep) -> str:
    with pytest.raises(ValueError) as error:
        validate_decode(step, table(), BLOCK_SIZE, NUM_BLOCKS)
    return str(error.value)


def test_consistent_steps_pass() -> None:
    t = table()
    validate_prefill(PrefillStep((new(3),), (CachedRequest(2, num_tokens=3),)), t,
                     BLOCK_SIZE, NUM_BLOCKS, VOCAB)
    # a request that leaves may come back in the same step (a preemption's recompute)
    validate_prefill(PrefillStep((new(1, 9, (5, 6, 7)),), finished_request_ids=(1,)), t,
                     BLOCK_SIZE, NUM_BLOCKS, VOCAB)
    validate_decode(DecodeStep((CachedRequest(1, (12,)),)), t, BLOCK_SIZE, NUM_BLOCKS)
    # finishing a request being prefilled, or every row, is a valid Decode
    validate_decode(DecodeStep(finished_request_ids=(2, 1)), t, BLOCK_SIZE, NUM_BLOCKS)


@pytest.mark.parametrize(("step", "message"), [
    (PrefillStep(), "a Prefill must compute at least one request"),
    (PrefillStep((new(3),), finished_request_ids=(9,)), "finished_request_ids [9] are not held"),
    (PrefillStep((new(3),), finished_request_ids=(2, 2)), "finished_request_ids repeat"),
    (PrefillStep((new(1),)), "request 1 is already held by this shard"),
    (PrefillStep((new(3), new(3))), "new_requests repeat a request id"),
    (PrefillStep((new(2),), (CachedRequest(2),)), "new_requests repeat a request id"),
    (PrefillStep(cached_requests=(CachedRequest(7),)), "request 7 is not held"),
    (PrefillStep(cached_requests=(CachedRequest(2),), finished_request_ids=(2,)),
     "request 2 is finished in the same step"),
    (PrefillStep(cached_requests=(CachedRequest(1),)),
     "request 1: its prefill is already complete"),
    (PrefillStep(cached_requests=(CachedRequest(2, num_tokens=6),)),
     "request 2: num_tokens=6 goes past its prompt (5 tokens left)"),
    (PrefillStep(cached_requests=(CachedRequest(2), CachedRequest(2))),
     "cached_requests name a request more than once"),
    (PrefillStep(cached_requests=(CachedRequest(2, (99,)),)),
     "request 2: new_block_ids [99] out of range [0, 64)"),
    (PrefillStep((new(3, 9),)), "request 3: block_ids has 2 blocks but 9 tokens need 3"),
    (PrefillStep((new(3, num_tokens=2, prompt_logprobs=True),)),
     "request 3: a request with prompt_logprobs cannot come in chunks"),
])
def test_bad_prefills_name_the_request_and_field(step: PrefillStep, message: str) -> None:
    assert message in prefill_error(step)


def test_a_chunk_needs_blocks_for_its_tokens() -> None:
    t = table()
    t.get(2).block_table[:] = [20, 21]  # 8 tokens of room; the rest of the prompt is 10
    with pytest.raises(ValueError, match="request 2: block_ids has 2 blocks but 10 tokens"):
        validate_prefill(PrefillStep(cached_requests=(CachedRequest(2),)), t,
                         BLOCK_SIZE, NUM_BLOCKS, VOCAB)
    validate_prefill(PrefillStep(cached_requests=(CachedRequest(2, num_tokens=3),)), t,
                     BLOCK_SIZE, NUM_BLOCKS, VOCAB)  # 8 tokens fit
    validate_prefill(PrefillStep(cached_requests=(CachedRequest(2, (23,)),)), t,
                     BLOCK_SIZE, NUM_BLOCKS, VOCAB)  # with a block appended


@pytest.mark.parametrize(("step", "message"), [
    (DecodeStep(finished_request_ids=(9,)), "finished_request_ids [9] are not held"),
    (DecodeStep((CachedRequest(9, (12,)),)), "request 9 is not held"),
    (DecodeStep((CachedRequest(2, (12,)),)), "request 2: its prefill is not complete"),
    (DecodeStep((CachedRequest(1, (12,)),), (1,)), "request 1 is finished in the same step"),
    (DecodeStep((CachedRequest(1, (64,)),)), "request 1: new_block_ids [64] out of range"),
    (DecodeStep((CachedRequest(1, (12,), 2),)), "request 1: num_tokens=2: a decode step"),
])
def test_bad_decodes_name_the_request_and_field(step: DecodeStep, message: str) -> None:
    assert message in decode_error(step)


def test_a_row_without_a_block_for_its_next_token_is_refused() -> None:
    t = table()
    t.get(1).seq_len = 8  # its next token (position 8) needs a third block
    t.get(1).token_ids.append(11)
    with pytest.raises(ValueError, match="request 1: block_ids has 2 blocks but 9 tokens need 3"):
        validate_decode(DecodeStep(), t, BLOCK_SIZE, NUM_BLOCKS)
    validate_decode(DecodeStep((CachedRequest(1, (12,)),)), t, BLOCK_SIZE, NUM_BLOCKS)
    validate_decode(DecodeStep(finished_request_ids=(1,)), t, BLOCK_SIZE, NUM_BLOCKS)
