"""Warm-up arithmetic that runs without a GPU: the worst-case prefill's layout and the
KV budget left by a measured CUDA memory profile."""

from __future__ import annotations

from shard.warmup import MemoryProfile, blocks_needed, dummy_chunks

GIB = 2**30


def test_worst_case_prefill_splits_into_longest_requests_on_shared_blocks() -> None:
    chunks = dummy_chunks(max_batch_prefill_tokens=100, max_total_tokens=40, block_size=16)
    assert [len(c.token_ids) for c in chunks] == [40, 40, 20]
    assert [list(c.block_table) for c in chunks] == [[0, 1, 2], [0, 1, 2], [0, 1]]
    assert blocks_needed(chunks) == 3


def test_kv_budget_leaves_out_activations_other_memory_and_graphs() -> None:
    # 80 GiB device at 0.9 = 72 GiB; CUDA context 1 GiB; the prefill peaked at 6 GiB of
    # which 2 GiB were its temporary cache (4 GiB of activations); graphs took 0.5 GiB.
    profile = MemoryProfile(80 * GIB, 6 * GIB, 1 * GIB, 2 * GIB, GIB // 2)
    assert profile.kv_budget(0.9) == int(80 * GIB * 0.9) - GIB - 4 * GIB - GIB // 2
    assert "KV budget 66.50 GiB" in profile.describe(0.9)
    assert profile.kv_budget(0.05) == 0  # less than nothing is nothing
