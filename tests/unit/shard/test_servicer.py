"""The gRPC servicer through a real ``grpc.aio`` server on 127.0.0.1 and a real stub."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from shard.config import ShardConfig
from shard.pb import shard_pb2 as pb
from shard.pb import shard_pb2_grpc
from shard.server import start_server
from tests.unit.shard.conftest import NEW_TOKENS
from tests.unit.shard.helpers import BLOCK_SIZE, PROMPTS


@pytest.fixture
async def stub(llama) -> AsyncIterator[shard_pb2_grpc.ShardServiceStub]:
    config = ShardConfig(
        model_path=str(llama[0]),
        model_id="tiny-llama",
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_bytes=1024 * 1024,
    )
    server, port = await start_server(config, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield shard_pb2_grpc.ShardServiceStub(channel)
    await server.stop(grace=None)


def req(rid: int, ids: list[int], blocks: list[int], **kw) -> pb.NewRequest:
    return pb.NewRequest(
        id=rid, input_ids=ids, block_ids=blocks, sampling=pb.SamplingParameters(), **kw
    )


async def test_info_health_and_not_warmed_up(stub) -> None:
    info = await stub.Info(pb.InfoRequest())
    assert (info.model_id, info.dtype, info.device, info.block_size, info.num_blocks) == (
        "tiny-llama",
        "float32",
        "cpu",
        BLOCK_SIZE,
        0,
    )
    assert (info.attention_backend, info.vocab_size, info.max_position_embeddings) == (
        "torch",
        256,
        512,
    )
    assert info.world_size == 1 and info.rank == 0 and "PyTorch" in info.attention_backend_reason
    await stub.Health(pb.HealthRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Prefill(pb.PrefillRequest(new_requests=[req(1, [5], [0])]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Warmup" in err.value.details()


async def test_full_session(stub, expected_greedy) -> None:
    warm = await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    # 1 MiB / (2 K/V * 2 layers * 4 tokens * 2 heads * 16 dims * 4 bytes) = 512
    assert (warm.num_blocks, warm.block_size) == (512, BLOCK_SIZE)
    assert (await stub.Info(pb.InfoRequest())).num_blocks == 512

    a, b = PROMPTS[1], PROMPTS[2]
    resp = await stub.Prefill(pb.PrefillRequest(
        new_requests=[req(10, a, [40, 3], top_n_tokens=2, prompt_logprobs=True)]))
    assert [g.token_id for g in resp.generations] == [expected_greedy[1][0]]
    g = resp.generations[0]
    assert g.request_id == 10
    assert len(g.top_tokens) == 2 and g.top_tokens[0].token_id == g.token_id
    assert g.top_tokens[0].logprob == pytest.approx(g.logprob)
    assert len(g.prompt_logprobs) == len(a) - 1 and all(lp < 0 for lp in g.prompt_logprobs)
    assert resp.timings.total_ns >= resp.timings.forward_ns > 0

    resp = await stub.Prefill(pb.PrefillRequest(new_requests=[req(20, b, [7, 9, 11, 1, 2])]))
    assert [g.request_id for g in resp.generations] == [20]
    tokens = {10: [expected_greedy[1][0]], 20: [resp.generations[0].token_id]}
    dec = await stub.Decode(pb.DecodeRequest(
        cached_requests=[pb.CachedRequest(id=10, new_block_ids=[100])]))
    # every row steps, in the order the requests finished their prefill
    assert len(dec.token_ids) == 2
    # a Generation message only for the request that asked for top tokens
    assert [g.request_id for g in dec.generations] == [10]
    assert len(dec.generations[0].top_tokens) == 2
    assert len(dec.logprobs) == 2 and all(lp <= 0.0 for lp in dec.logprobs)
    for rid, token in zip((10, 20), dec.token_ids, strict=True):
        tokens[rid].append(token)
    assert tokens[10] == expected_greedy[1][:2] and tokens[20] == expected_greedy[2][:2]

    # request 10 leaves with the next Decode; 20 steps alone
    dec = await stub.Decode(pb.DecodeRequest(finished_request_ids=[10]))
    assert list(dec.token_ids) == [expected_greedy[2][2]] and list(dec.generations) == []
    with pytest.raises(grpc.aio.AioRpcError) as finished:
        await stub.Decode(pb.DecodeRequest(finished_request_ids=[10]))
    assert finished.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "finished_request_ids [10] are not held" in (finished.value.details() or "")
    # the rejected step changed nothing: 20 goes on
    dec = await stub.Decode(pb.DecodeRequest())
    assert list(dec.token_ids) == [expected_greedy[2][3]]
    # the last row leaves: nothing is computed
    dec = await stub.Decode(pb.DecodeRequest(finished_request_ids=[20]))
    assert list(dec.token_ids) == [] and list(dec.logprobs) == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Decode(pb.DecodeRequest(cached_requests=[pb.CachedRequest(
            id=20, new_block_ids=[5])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 20 is not held" in (err.value.details() or "")
    assert NEW_TOKENS > 4


async def test_chunked_prefill_by_request_id(stub, expected_greedy) -> None:
    """A prompt in three chunks: a NewRequest with num_tokens, a CachedRequest with
    num_tokens, then one for the rest (0); only the last samples."""
    await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    prompt = PROMPTS[3]  # 40 tokens
    blocks = list(range(20, 31))  # 41 tokens: the prompt and one decode step
    first = await stub.Prefill(pb.PrefillRequest(
        new_requests=[req(7, prompt, blocks, num_tokens=16)]))
    assert list(first.generations) == []
    second = await stub.Prefill(pb.PrefillRequest(
        cached_requests=[pb.CachedRequest(id=7, num_tokens=11)]))
    assert list(second.generations) == []
    last = await stub.Prefill(pb.PrefillRequest(cached_requests=[pb.CachedRequest(id=7)]))
    assert [(g.request_id, g.token_id) for g in last.generations] == [(7, expected_greedy[3][0])]
    dec = await stub.Decode(pb.DecodeRequest())
    assert list(dec.token_ids) == [expected_greedy[3][1]]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # its prefill is complete
        await stub.Prefill(pb.PrefillRequest(cached_requests=[pb.CachedRequest(id=7)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 7: its prefill is already complete" in (err.value.details() or "")


async def test_bad_requests_get_clear_status_and_server_keeps_serving(
    stub, expected_greedy
) -> None:
    await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    cases = [
        (
            pb.DecodeRequest(finished_request_ids=[77]),
            "Decode",
            grpc.StatusCode.INVALID_ARGUMENT,
            "finished_request_ids [77] are not held by this shard",
        ),
        (
            pb.PrefillRequest(finished_request_ids=[77], new_requests=[req(1, [5], [0])]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "finished_request_ids [77] are not held by this shard",
        ),
        (
            pb.DecodeRequest(cached_requests=[pb.CachedRequest(id=77, new_block_ids=[1])]),
            "Decode",
            grpc.StatusCode.INVALID_ARGUMENT,
            "request 77 is not held by this shard",
        ),
        (
            pb.PrefillRequest(cached_requests=[pb.CachedRequest(id=5)]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "request 5 is not held by this shard",
        ),
        (
            pb.PrefillRequest(),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "a Prefill must compute at least one request",
        ),
        (
            pb.PrefillRequest(new_requests=[req(1, PROMPTS[2], [0, 1])]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "request 1: block_ids has 2 blocks but 17 tokens need 5",
        ),
        (
            pb.PrefillRequest(new_requests=[req(1, [5, 6], [5000])]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "out of range [0, 512)",
        ),
        (
            pb.PrefillRequest(new_requests=[req(1, [5, 6], [0], cache_len=2)]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "cache_len=2 must be < len(input_ids)=2",
        ),
        (
            pb.PrefillRequest(new_requests=[req(1, [5, 999], [0])]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "out of vocabulary",
        ),
        (
            pb.PrefillRequest(new_requests=[req(1, [5], [0]), req(1, [6], [1])]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "new_requests repeat a request id",
        ),
        (
            pb.PrefillRequest(new_requests=[
                req(1, [5, 6, 7], [0], num_tokens=1, prompt_logprobs=True)]),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "request 1: a request with prompt_logprobs cannot come in chunks",
        ),
        (
            pb.PrefillRequest(
                new_requests=[
                    pb.NewRequest(
                        id=1,
                        input_ids=[5],
                        block_ids=[0],
                        sampling=pb.SamplingParameters(top_p=1.5),
                    )
                ],
            ),
            "Prefill",
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be in (0, 1]",
        ),
        (
            pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=10**6),
            "Warmup",
            grpc.StatusCode.INVALID_ARGUMENT,
            "--kv-cache-bytes",
        ),
    ]
    for message, method, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(stub, method)(message)
        assert err.value.code() == code, (method, err.value.details())
        assert text in err.value.details()
    # still serving: warm up again (the failed warmup dropped the cache) and generate
    await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    resp = await stub.Prefill(pb.PrefillRequest(new_requests=[req(1, PROMPTS[0], [8])]))
    assert resp.generations[0].token_id == expected_greedy[0][0]
    # a new request with an id already held is rejected, and the held one is untouched
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Prefill(pb.PrefillRequest(new_requests=[req(1, PROMPTS[1], [3, 4])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1 is already held by this shard" in err.value.details()
    # decode without the needed new block is rejected without losing the row
    for _ in range(3):
        await stub.Decode(pb.DecodeRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Decode(pb.DecodeRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1: block_ids has 1 blocks but 5 tokens need 2" in err.value.details()
    dec = await stub.Decode(pb.DecodeRequest(
        cached_requests=[pb.CachedRequest(id=1, new_block_ids=[9])]))
    assert list(dec.token_ids) == [expected_greedy[0][4]]


async def test_steps_run_in_the_routers_order_whatever_the_arrival_order(
    stub, expected_greedy
) -> None:
    """The router sends Decode (step 2) right behind the Prefill (step 1) it depends
    on; when the Decode arrives first it waits for the Prefill."""
    import asyncio

    await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    prompt = PROMPTS[1]
    decode = asyncio.ensure_future(stub.Decode(pb.DecodeRequest(step=2)))
    await asyncio.sleep(0.2)  # the Decode is at the shard, waiting for step 1
    assert not decode.done()
    prefill = await stub.Prefill(
        pb.PrefillRequest(new_requests=[req(1, prompt, [0, 1, 2])], step=1)
    )
    dec = await decode
    assert dec.step == 2
    assert [prefill.generations[0].token_id, *dec.token_ids] == expected_greedy[1][:2]
    # a restart step (the first after a failed one; the numbering goes on) runs after
    # the shard dropped what it held: the same id is new again, and request 1's old
    # row does not decode
    again = await stub.Prefill(
        pb.PrefillRequest(new_requests=[req(1, prompt, [3, 4, 5])], step=4, restart=True)
    )
    assert again.generations[0].token_id == expected_greedy[1][0]
    dec = await stub.Decode(pb.DecodeRequest(step=5))
    assert list(dec.token_ids) == [expected_greedy[1][1]]
    # a step from before the restart (step 3, lost by the router) is abandoned
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Decode(pb.DecodeRequest(step=3))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 3 was abandoned" in (err.value.details() or "")


async def test_a_step_launched_for_a_cancelled_call_is_still_read(
    stub, expected_greedy, monkeypatch
) -> None:
    # The Prefill's deadline passes while its launch runs: the launched step is read all
    # the same, so the steps after it (which wait for it in launch order) go on.
    import asyncio
    import time

    from shard.model_runner import ModelRunner

    await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128))
    a, b = PROMPTS[1], PROMPTS[2]
    await stub.Prefill(pb.PrefillRequest(new_requests=[req(1, a, [0, 1, 2, 3, 4])]))
    launch = ModelRunner.launch_prefill

    def slow_launch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launched = launch(self, *args, **kwargs)
        time.sleep(1.0)
        return launched

    monkeypatch.setattr(ModelRunner, "launch_prefill", slow_launch)
    with pytest.raises(grpc.aio.AioRpcError) as cancelled:
        await stub.Prefill(pb.PrefillRequest(new_requests=[
            req(2, b, [10, 11, 12, 13, 14])]), timeout=0.3)
    assert cancelled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(1.5)  # the launch ends meanwhile
    # the abandoned Prefill's request is held: both rows step, each with its own token
    decoded = await stub.Decode(pb.DecodeRequest(), timeout=10.0)
    assert list(decoded.token_ids) == [expected_greedy[1][1], expected_greedy[2][1]]
