"""What the shard decodes from a Prefill request: only what it reads."""

from __future__ import annotations

from shard.pb import shard_pb2 as pb
from shard.pb_convert import request_from_pb


def test_stopping_parameters_are_not_decoded() -> None:
    """The router decides when a request stops; the shard neither reads nor keeps the
    request's stopping parameters."""
    plain = pb.Request(id=3, input_ids=[5, 6, 7], cache_len=1, block_ids=[0], top_n_tokens=2,
                       sampling=pb.SamplingParameters(do_sample=True, seed=11, top_k=4))
    with_stopping = pb.Request()
    with_stopping.CopyFrom(plain)
    with_stopping.stopping.CopyFrom(
        pb.StoppingParameters(max_new_tokens=9, stop_token_ids=[2], ignore_eos=True))
    decoded = request_from_pb(with_stopping)
    assert decoded == request_from_pb(plain)
    assert (decoded.request_id, decoded.input_ids, decoded.cache_len, decoded.block_ids,
            decoded.top_n_tokens, decoded.sampling.top_k) == (3, (5, 6, 7), 1, (0,), 2, 4)
