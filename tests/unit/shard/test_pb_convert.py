"""What the shard decodes from Prefill and Decode requests, and that the router sends no
stopping parameters (it alone decides when a request stops)."""

from __future__ import annotations

from shard.pb import shard_pb2 as pb
from shard.pb_convert import decode_step_from_pb, new_request_from_pb, prefill_step_from_pb
from shard.records import CachedRequest, DecodeStep


def test_a_request_carries_no_stopping_parameters() -> None:
    assert "stopping" not in pb.NewRequest.DESCRIPTOR.fields_by_name
    assert not hasattr(pb, "StoppingParameters")


def test_request_fields_are_decoded() -> None:
    message = pb.NewRequest(id=3, input_ids=[5, 6, 7], cache_len=1, block_ids=[0],
                            top_n_tokens=2, num_generated=1, num_tokens=1,
                            sampling=pb.SamplingParameters(do_sample=True, seed=11, top_k=4))
    decoded = new_request_from_pb(message)
    assert (decoded.request_id, decoded.input_ids, decoded.cache_len, decoded.block_ids,
            decoded.top_n_tokens, decoded.num_generated, decoded.num_tokens) == (
        3, (5, 6, 7), 1, (0,), 2, 1, 1)
    assert (decoded.end, decoded.partial) == (2, True)
    assert (decoded.sampling.do_sample, decoded.sampling.seed, decoded.sampling.top_k,
            decoded.sampling.temperature) == (True, 11, 4, 1.0)  # unset temperature: 1.0


def test_steps_are_decoded_in_order() -> None:
    prefill = prefill_step_from_pb(pb.PrefillRequest(
        finished_request_ids=[4, 2],
        cached_requests=[pb.CachedRequest(id=8, num_tokens=16), pb.CachedRequest(id=6)],
        new_requests=[pb.NewRequest(id=9, input_ids=[5], block_ids=[1]),
                      pb.NewRequest(id=1, input_ids=[6], block_ids=[2])],
        step=3,
    ))
    assert prefill.finished_request_ids == (4, 2)
    assert prefill.cached_requests == (CachedRequest(8, (), 16), CachedRequest(6, (), 0))
    assert [r.request_id for r in prefill.new_requests] == [9, 1]
    assert [r.num_tokens for r in prefill.new_requests] == [0, 0]  # 0: the whole prompt
    decode = decode_step_from_pb(pb.DecodeRequest(
        finished_request_ids=[7],
        cached_requests=[pb.CachedRequest(id=5, new_block_ids=[10, 11])],
        step=4,
    ))
    assert decode == DecodeStep((CachedRequest(5, (10, 11), 0),), (7,))
    assert decode_step_from_pb(pb.DecodeRequest()) == DecodeStep()


def test_sampling_fields_unset_are_off_and_set_ones_are_taken_as_sent() -> None:
    import pytest

    from shard.pb_convert import sampling_from_pb
    from shard.sampling_types import SamplingParams

    assert sampling_from_pb(pb.SamplingParameters()) == SamplingParams()
    sent = sampling_from_pb(pb.SamplingParameters(
        do_sample=True, temperature=0.5, top_p=0.9, typical_p=0.8, repetition_penalty=1.2))
    assert (sent.temperature, sent.top_p, sent.typical_p, sent.repetition_penalty) == (
        pytest.approx(0.5), pytest.approx(0.9), pytest.approx(0.8), pytest.approx(1.2))
    # a zero that is sent is not read as "off": temperature 0 is refused by name
    with pytest.raises(ValueError, match="temperature"):
        sampling_from_pb(pb.SamplingParameters(do_sample=True, temperature=0.0))
