"""What the shard decodes from a Prefill request, and that the router sends no stopping
parameters (it alone decides when a request stops)."""

from __future__ import annotations

from shard.pb import shard_pb2 as pb
from shard.pb_convert import request_from_pb


def test_a_request_carries_no_stopping_parameters() -> None:
    assert "stopping" not in pb.Request.DESCRIPTOR.fields_by_name
    assert not hasattr(pb, "StoppingParameters")


def test_request_fields_are_decoded() -> None:
    message = pb.Request(id=3, input_ids=[5, 6, 7], cache_len=1, block_ids=[0],
                         top_n_tokens=2, num_generated=1,
                         sampling=pb.SamplingParameters(do_sample=True, seed=11, top_k=4))
    decoded = request_from_pb(message)
    assert (decoded.request_id, decoded.input_ids, decoded.cache_len, decoded.block_ids,
            decoded.top_n_tokens, decoded.num_generated) == (3, (5, 6, 7), 1, (0,), 2, 1)
    assert (decoded.sampling.do_sample, decoded.sampling.seed, decoded.sampling.top_k,
            decoded.sampling.temperature) == (True, 11, 4, 1.0)  # unset temperature: 1.0
