"""Warm-up arithmetic that runs without a GPU: the worst-case prefill's layout, the
extra steps that reach Triton's kernel variants, the compile watch armed after warm-up,
and the KV budget left by a measured CUDA memory profile."""

from __future__ import annotations

from shard.kernels.compile_watch import CompileWatch
from shard.warmup import MemoryProfile, blocks_needed, dummy_chunks, odd_shapes

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


def test_odd_shapes_reach_each_size_class_of_tokens_and_sequences() -> None:
    # Triton compiles a variant per integer argument that is 1, a multiple of 16 or
    # neither: warm-up's extra steps give each class of token and sequence counts
    first = dummy_chunks(max_batch_prefill_tokens=64, max_total_tokens=128, block_size=4)[0]
    steps = odd_shapes(first)
    assert len(steps) == 5
    tokens = [sum(len(c.token_ids) for c in step) for step in steps]
    sequences = [len(step) for step in steps]

    def classes(values: list[int]) -> set[str]:
        return {"one" if v == 1 else "x16" if v % 16 == 0 else "other" for v in values}

    assert classes([*tokens, 64]) == classes([*sequences, 16]) == {"one", "x16", "other"}
    for step in steps:
        for chunk in step:
            end = chunk.start + len(chunk.token_ids)
            assert chunk.token_ids == first.token_ids[chunk.start:end] and end <= 64
    assert any(c.start % 4 for step in steps for c in step)  # prefixes off a block's end
    # a first chunk too short for some of them keeps those that fit
    short = dummy_chunks(max_batch_prefill_tokens=20, max_total_tokens=20, block_size=4)[0]
    assert [len(s) for s in odd_shapes(short)] == [1, 1]


def test_the_compile_watch_logs_only_after_warm_up() -> None:
    watch = CompileWatch()
    seen = []

    class Fn:
        name = "_rms_norm_kernel"

    watch._seen({"fn": Fn(), "repr": "_rms_norm_kernel[num_warps=4](n_rows: i32)"})
    watch.arm()
    watch._seen({"fn": Fn(), "repr": "_rms_norm_kernel[num_warps=4](n_rows: i32)"})
    seen.extend(watch.late)
    watch.disarm()
    watch._seen({"fn": Fn(), "repr": "x"})
    assert seen == watch.late == [("_rms_norm_kernel",
                                   "_rms_norm_kernel[num_warps=4](n_rows: i32)")]


def test_warm_up_runs_the_odd_steps_and_an_eager_decode_per_backend_context(
        llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.shard.helpers import BLOCK_SIZE, make_runner

    runner = make_runner(llama[0], warmup=False)
    # the Triton backend names one context per decode kernel variant; the torch one none
    monkeypatch.setattr(type(runner.backend), "eager_decode_contexts",
                        lambda self, kv_heads, longest: [5, 33])
    steps: list[tuple[bool, list[tuple[int, int]]]] = []
    run_chunks = runner.run_chunks

    def spy(chunks, is_prefill):  # type: ignore[no-untyped-def]
        steps.append((is_prefill, [(len(c.token_ids), c.start) for c in chunks]))
        return run_chunks(chunks, is_prefill)

    runner.run_chunks = spy  # type: ignore[method-assign]
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    assert [s for p, s in steps if not p] == [[(1, 4)], [(1, 32)]]
    prefills = [s for p, s in steps if p]
    assert prefills[0] == [(64, 0)]  # the worst-case prefill, then its prefix chunk
    assert prefills[2:] == [[(len(c.token_ids), c.start) for c in shape]
                            for shape in odd_shapes(dummy_chunks(64, 128, BLOCK_SIZE)[0])]
