"""The replica routing policy (router/serve/affinity.py), its route hints (the same
block digests as the replicas' prefix caches), the per-replica /metrics join, and a
replica's prefix cache keeping a chat's answers for its next turn."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.block_manager import BlockManager, block_hashes
from router.chat_template import encode_chat_prompt, render_chat
from router.serve.affinity import (
    KV_FULL,
    REPORT_STALENESS_S,
    PrefixIndex,
    ReplicaChooser,
    RouteHint,
)
from router.serve.board import merge_expositions
from router.serve.hints import HintMaker

BLOCK = 4


def chain(*tokens: int) -> tuple[bytes, ...]:
    return tuple(block_hashes(list(tokens), BLOCK))


SYSTEM = tuple(range(100, 116))  # four blocks shared by every prompt below


def test_match_counts_leading_blocks_per_replica() -> None:
    index = PrefixIndex()
    index.insert("a", chain(*SYSTEM, 1, 2, 3, 4))
    index.insert("b", chain(*SYSTEM))
    assert index.match(chain(*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8)) == {"a": 5, "b": 4}
    assert index.match(chain(9, *SYSTEM)) == {}  # same blocks later: another chain


def test_eviction_follows_the_replica_lru_tail_first() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 3)
    index.insert("a", chain(*SYSTEM))  # 4 blocks into 3: the chain's tail goes first
    assert index.blocks_of("a") == 3
    assert index.match(chain(*SYSTEM)) == {"a": 3}
    index.insert("a", chain(7, 7, 7, 7))  # a newer chain pushes the old one's tail out
    assert index.match(chain(*SYSTEM)) == {"a": 2}
    index.remove_replica("a")
    assert len(index) == 0 and index.match(chain(7, 7, 7, 7)) == {}


def test_prefix_goes_to_its_holder_until_the_load_gap_is_too_wide() -> None:
    chooser = ReplicaChooser(policy="affinity", max_gap=2)
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM, 1, 2, 3, 4))
    chooser.routed("a", hint, "r0")
    for n in range(1, 3):  # a is 1, then 2 requests ahead of b: within the gap
        decision = chooser.choose(["a", "b"], hint)
        assert (decision.replica, decision.reason, decision.cached_blocks) == ("a", "prefix", 5)
        chooser.routed("a", hint, f"r{n}")
    decision = chooser.choose(["a", "b"], hint)  # 3 ahead: the least loaded takes it
    assert (decision.replica, decision.reason) == ("b", "least_loaded")
    chooser.completed("r0")
    assert chooser.choose(["a", "b"], hint).replica == "a"


def test_the_deepest_match_wins_within_the_band() -> None:
    chooser = ReplicaChooser(max_gap=4)
    chooser.set_replicas(["a", "b"])
    chooser.routed("a", RouteHint(chain(*SYSTEM)), "r0")
    chooser.routed("b", RouteHint(chain(*SYSTEM, 5, 5, 5, 5)), "r1")
    decision = chooser.choose(["a", "b"], RouteHint(chain(*SYSTEM, 5, 5, 5, 5, 6, 6, 6, 6)))
    assert (decision.replica, decision.cached_blocks) == ("b", 5)


def test_a_full_kv_cache_takes_a_replica_out_of_the_band() -> None:
    chooser = ReplicaChooser(max_gap=4)
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM))
    chooser.routed("a", hint, "r0")
    chooser.completed("r0")
    chooser.report("a", {"queue_size": 0, "running": 0, "kv_blocks_total": 100,
                         "kv_blocks_used": int(100 * KV_FULL)})
    assert chooser.choose(["a", "b"], hint).replica == "b"
    chooser.report("a", {"queue_size": 0, "running": 0, "kv_blocks_total": 100,
                         "kv_blocks_used": 10})
    assert chooser.choose(["a", "b"], hint).replica == "a"


def test_a_passed_over_holder_is_counted_with_why() -> None:
    chooser = ReplicaChooser(max_gap=0)
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM, 1, 2, 3, 4))
    chooser.routed("a", hint, "r0")  # a holds 5 blocks and is one request ahead
    chooser.routed("b", RouteHint(chain(*SYSTEM)), "r1")
    chooser.completed("r1")
    decision = chooser.choose(["a", "b"], hint)
    assert (decision.replica, decision.reason, decision.cached_blocks) == ("b", "prefix", 4)
    assert decision.passed_over == "load"
    chooser.completed("r0")
    chooser.report("a", {"queue_size": 0, "running": 0, "kv_blocks_total": 100,
                         "kv_blocks_used": 100})
    assert chooser.choose(["a", "b"], hint).passed_over == "kv_full"
    chooser.report("a", {"queue_size": 0, "running": 0, "kv_blocks_total": 100,
                         "kv_blocks_used": 0})
    decision = chooser.choose(["a", "b"], hint)
    assert (decision.replica, decision.cached_blocks, decision.passed_over) == ("a", 5, None)
    assert chooser.passed_over == {"load": 1, "kv_full": 1}
    robin = ReplicaChooser(policy="round_robin")
    robin.routed("a", hint, "r0")
    decisions = [robin.choose(["a", "b"], hint) for _ in range(2)]
    assert [(d.replica, d.cached_blocks, d.passed_over) for d in decisions] == [
        ("a", 5, None), ("b", 0, "policy")]


def test_reported_load_counts_other_routers_requests() -> None:
    now = [0.0]
    chooser = ReplicaChooser(max_gap=1, clock=lambda: now[0])
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM))
    chooser.routed("a", hint, "r0")
    chooser.completed("r0")
    chooser.report("a", {"queue_size": 3, "running": 2})
    # the report may still count r0, which finished just now
    assert chooser.loads["a"].ongoing(now[0]) == 4
    now[0] += REPORT_STALENESS_S + 0.1
    assert chooser.loads["a"].ongoing(now[0]) == 5
    assert chooser.choose(["a", "b"], hint).replica == "b"


def test_a_conversation_turn_is_not_pushed_off_by_its_own_last_turn() -> None:
    # Its last turn just finished on a; a's report (up to a period old) still counts it.
    now = [0.0]
    chooser = ReplicaChooser(max_gap=0, clock=lambda: now[0])
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM), conversation="alice")
    chooser.routed("a", hint, "r0")
    chooser.completed("r0")
    chooser.report("a", {"queue_size": 0, "running": 1})
    decision = chooser.choose(["a", "b"], RouteHint(chain(*SYSTEM, 1, 2, 3, 4), "alice"))
    assert (decision.replica, decision.reason, decision.cached_blocks) == ("a", "conversation", 4)


def test_conversation_stays_on_its_replica() -> None:
    chooser = ReplicaChooser(max_gap=4)
    chooser.set_replicas(["a", "b"])
    chooser.routed("b", RouteHint(conversation="alice"), "r0")
    chooser.routed("a", RouteHint(chain(*SYSTEM)), "r1")
    decision = chooser.choose(["a", "b"], RouteHint(chain(*SYSTEM), conversation="alice"))
    assert (decision.replica, decision.reason) == ("b", "conversation")


def test_gone_replicas_are_forgotten() -> None:
    chooser = ReplicaChooser()
    chooser.set_replicas(["a", "b"])
    hint = RouteHint(chain(*SYSTEM), conversation="c")
    chooser.routed("a", hint, "r0")
    chooser.set_replicas(["b", "c"])
    assert "a" not in chooser.loads and chooser.index.match(hint.block_hashes) == {}
    assert chooser.choose(["b", "c"], hint).replica in ("b", "c")
    chooser.completed("r0")  # its replica is gone: nothing to count down


def test_a_request_routed_again_counts_once() -> None:
    chooser = ReplicaChooser()
    chooser.set_replicas(["a", "b"])
    chooser.routed("a", None, "r0")
    chooser.routed("a", None, "r0")
    chooser.routed("b", None, "r0")
    assert (chooser.loads["a"].in_flight, chooser.loads["b"].in_flight) == (0, 1)
    chooser.completed("r0")
    assert chooser.loads["b"].in_flight == 0


def test_baselines() -> None:
    robin = ReplicaChooser(policy="round_robin")
    assert [robin.choose(["a", "b", "c"]).replica for _ in range(4)] == ["a", "b", "c", "a"]
    least = ReplicaChooser(policy="least_loaded")
    least.set_replicas(["a", "b"])
    least.routed("a", None, "r0")
    hint = RouteHint(chain(*SYSTEM))
    least.routed("a", hint, "r1")
    assert least.choose(["a", "b"], hint).replica == "b"  # no affinity
    with pytest.raises(ValueError, match="no replica"):
        least.choose([])


def test_route_digests_are_the_prefix_cache_digests(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """What the replica's block manager indexes for a prompt is what the hint carries:
    a replica that prefilled the prompt matches every full block of it."""
    maker = HintMaker(tokenizer, block_size=16)
    text = "You are a helpful assistant. " * 8
    hint = maker.for_http("/generate", json.dumps({"inputs": text}).encode(), {})
    assert hint is not None
    ids = tokenizer.encode(text)
    manager = BlockManager(num_blocks=64, block_size=16)
    blocks = manager.allocate(manager.blocks_for_tokens(len(ids)))
    manager.register(block_hashes(ids, 16), blocks)
    assert len(hint.block_hashes) == len(ids) // 16 > 0
    assert manager.match_prefix(hint.block_hashes) == blocks[: len(ids) // 16]

    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]
    chat = maker.for_http("/v1/chat/completions",
                          json.dumps({"model": "m", "messages": messages, "user": "u1"}).encode(),
                          {})
    chat_ids = encode_chat_prompt(tokenizer, render_chat(tokenizer, messages))
    assert chat is not None and chat.conversation == "u1"
    assert chat.block_hashes == tuple(block_hashes(chat_ids, 16))
    truncated = maker.for_http("/generate", json.dumps(
        {"inputs": text, "parameters": {"truncate": 40}}).encode(), {})
    assert truncated is not None
    assert truncated.block_hashes == tuple(block_hashes(ids[-40:], 16))


def test_hints_of_other_calls(tokenizer) -> None:  # type: ignore[no-untyped-def]
    maker = HintMaker(tokenizer, block_size=16)
    assert maker.for_http("/info", b"", {}) is None
    broken = maker.for_http("/generate", b"{not json", {"x-conversation-id": "c1"})
    assert broken is not None and broken.block_hashes == () and broken.conversation == "c1"
    ids = list(range(40))
    tokens = maker.for_http("/v1/completions", json.dumps({"prompt": ids}).encode(), {})
    assert tokens is not None and tokens.block_hashes == tuple(block_hashes(ids, 16))


def test_metrics_join_labels_every_replica() -> None:
    one = (b"# HELP shardserve_queue_size Requests waiting\n# TYPE shardserve_queue_size gauge\n"
           b"shardserve_queue_size 2.0\n"
           b"# HELP shardserve_requests_total Finished\n# TYPE shardserve_requests_total counter\n"
           b'shardserve_requests_total{outcome="success"} 3.0\n')
    two = one.replace(b"2.0", b"5.0").replace(b"3.0", b"7.0")
    text = merge_expositions({"r1": one, "r2": two}, b"# TYPE x_total counter\nx_total 1\n")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    queue = {s.labels["replica"]: s.value for s in families["shardserve_queue_size"].samples}
    assert queue == {"r1": 2.0, "r2": 5.0}
    done = [(s.labels, s.value) for s in families["shardserve_requests"].samples]
    assert done == [({"replica": "r1", "outcome": "success"}, 3.0),
                    ({"replica": "r2", "outcome": "success"}, 7.0)]
    assert families["x"].samples[0].value == 1
    assert text.count(b"# TYPE shardserve_queue_size") == 1
    with pytest.raises(ValueError, match="not a sample line"):
        merge_expositions({"r1": b"{oops} 1\n"})


async def test_a_chat_turn_is_served_from_the_previous_answer_blocks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Turn 2's prompt is turn 1's prompt + answer + a new message: the answer's full
    # blocks come from the cache too, on blocks holding its tokens (the scripted shard
    # checks every hit).
    from router.config import SchedulerConfig
    from router.engine.loop import Engine
    from router.request import GenerationRequest, SamplingParams, StoppingParams, TokenEvent
    from tests.unit.api.kv_scripted import KvScriptedShardClient

    def script(prompt: tuple[int, ...]) -> list[int]:
        return [200 + (sum(prompt) + i) % 50 for i in range(64)]

    def request(prompt: tuple[int, ...], tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt, SamplingParams(), StoppingParams(max_new_tokens=tokens, ignore_eos=True)
        )

    shard = KvScriptedShardClient(script, num_blocks=64, block_size=BLOCK)
    config = SchedulerConfig(max_input_tokens=96, max_total_tokens=128,
                             max_batch_prefill_tokens=256, steps_in_flight=2)
    engine = Engine(shard, tokenizer, config, shard.num_blocks, shard.block_size)  # type: ignore[arg-type]
    engine.start()
    try:
        prompt = tuple(range(10, 30))  # 20 tokens, 5 blocks
        answer = [e.id async for e in engine.generate(request(prompt, 10))
                  if isinstance(e, TokenEvent)]
        turn2 = (*prompt, *answer, 7, 8, 9)
        second = [e async for e in engine.generate(request(turn2, 4))]
        # 30 tokens were in its sequence, 29 with K/V: 7 full blocks of 4
        assert shard.prefilled[-1].cache_len == 28 and len(second) == 4
        assert engine.block_manager.hit_tokens == 28
    finally:
        await engine.stop()
