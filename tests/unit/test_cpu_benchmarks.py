"""The virtual devices the CPU benchmarks measure the router against: the router's
period follows the device's step (locally and behind gRPC), scheduling runs a GPU
workload to the end, and the shard's host step runs without a model forward; the
block-locality benchmark's schedule tells the allocators apart."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving import speculative_cpu
from benchmarks.serving.workloads import Workload
from benchmarks.simulations import block_locality, schedule_sim
from benchmarks.steps import router_step, shard_step, speculative_verify, step_chain
from router.config import SchedulerConfig
from router.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("grpc", [False, True], ids=["local", "grpc"])
def test_the_router_period_follows_a_virtual_device(tokenizer: Tokenizer, grpc: bool) -> None:
    # every request gets all its tokens (run_engine asserts it) and the period the
    # router sees is the device's step, not the instant answers' near-zero
    setup = router_step.Setup(device_s=0.02, grpc=grpc)
    cost = asyncio.run(router_step.run_engine(tokenizer, 4, 12, False, setup))
    assert 0.018 < cost.period_s < 0.2 and cost.cpu_s > 0


def test_a_prefill_takes_its_tokens_time() -> None:
    shards = router_step.TimedShards([7], num_blocks=8, step_s=0.0, prefill_token_s=0.01)
    pb = router_step.pb
    first = pb.PrefillRequest(new_requests=[
        pb.NewRequest(id=1, input_ids=list(range(10)), cache_len=4, block_ids=[0])])
    # a chunk of 3 tokens of a held request, then the rest (5) by id
    chunked = pb.NewRequest(id=2, input_ids=list(range(8)), block_ids=[1], num_tokens=3)
    rest = pb.PrefillRequest(cached_requests=[pb.CachedRequest(id=2)])

    async def timed(request: pb.PrefillRequest) -> tuple[float, list[int]]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await shards.prefill(request)
        return loop.time() - started, [g.request_id for g in response.generations]

    async def run() -> list[tuple[float, list[int]]]:
        return [await timed(first), await timed(pb.PrefillRequest(new_requests=[chunked])),
                await timed(rest)]

    (whole_s, whole), (chunk_s, chunk), (rest_s, done) = asyncio.run(run())
    assert whole_s >= 0.059 and whole == [1]  # six tokens computed, the cached four not
    assert chunk_s >= 0.029 and chunk == []  # a first chunk samples nothing
    assert rest_s >= 0.049 and done == [2] and shards.rows == [1, 2]


def test_the_schedule_simulation_serves_a_workload(tokenizer: Tokenizer) -> None:
    workload = Workload("small", [[5 + i] * (20 + i) for i in range(6)], [3, 5, 8, 2, 4, 6])
    config = SchedulerConfig(max_batch_prefill_tokens=64, max_batch_size=4,
                             max_input_tokens=32, max_total_tokens=48,
                             max_concurrent_requests=6, waiting_served_ratio=0.0)
    wall = asyncio.run(schedule_sim.run(tokenizer, workload, config, 0.001, 1e-5))
    assert wall > 0.001 * max(workload.output_lens)
    with pytest.raises(AssertionError, match="all its tokens"):
        # 27 tokens in all: the longer prompts cannot get all their new tokens
        short = dataclasses.replace(config, max_input_tokens=26, max_total_tokens=27)
        asyncio.run(schedule_sim.run(tokenizer, workload, short, 0.0, 0.0))


def test_expected_tokens_per_verify_step() -> None:
    # Leviathan et al. 2023: (1 - a^(k+1)) / (1 - a); k + 1 when every proposal is kept
    assert speculative_verify.expected_tokens(0.7, 4) == pytest.approx(2.7731)
    assert speculative_verify.expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert speculative_verify.expected_tokens(1.0, 4) == 5.0
    assert speculative_verify.expected_tokens(0.0, 7) == 1.0


def test_the_verify_steps_find_the_greedy_decode_tokens(tmp_path: Path) -> None:
    # each row's last token and 3, 0 or 2 guesses over the cached context, through the
    # decode rows serving runs (SpeculativeDecoder.verify_logits) and through the varlen
    # prefill path: fed the tokens greedy decoding chose, the argmax after each is the next
    # of them, and nothing advances
    import json

    from benchmarks.steps.dummy_model import SMALL, prefill_requests
    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner
    from shard.speculative.step import SpeculativeDecoder

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device="cpu", block_size=16,
                                     dtype="float32", load_format="dummy",
                                     kv_cache_bytes=64 << 20))
    runner.warmup(1024, 1024, 4)
    prefill_requests(runner, 3, 20, steps=8)
    decoded: list[list[int]] = [[] for _ in runner.requests.decoding]
    for _ in range(4):
        for g in runner.decode().generations:
            decoded[g.request_id].append(g.token_id)
    runner.reset()
    prefill_requests(runner, 3, 20, steps=8)  # the same rows again, before those steps
    rows = list(runner.requests.decoding)
    guesses = [tokens[:m] for tokens, m in zip(decoded, (3, 0, 2), strict=True)]
    want = [t for tokens, g in zip(decoded, guesses, strict=True) for t in tokens[:len(g) + 1]]
    decoder = SpeculativeDecoder(runner, speculative_verify.FixedGuesses(guesses))
    assert speculative_verify.verify_step(decoder, rows, guesses) == want
    chunks = speculative_verify.verify_chunks(rows, guesses)
    assert speculative_verify.verify_forward(runner, chunks) == want
    assert not speculative_verify.verify_graphed(runner, rows, guesses)  # no graphs on CPU
    assert [r.seq_len for r in runner.requests.decoding] == [20] * 3
    assert len({t for tokens in decoded for t in tokens}) > 3  # not one token everywhere


def test_the_speculative_report_has_every_batch_and_lookahead(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    report = speculative_verify.main([
        "--tiny", "--device", "cpu", "--batch", "1", "3", "--context", "24", "--reps", "1",
        "--warmup-reps", "1", "--lookahead", "1", "4", "--acceptance", "ngram/grounded=0.6",
        "--out", str(out)])
    assert out.read_text() == report
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ")]
    # batch, 2 decode, verify and varlen eager at k+1 = 2 and 5, 2 draft, propose at k = 1
    # and 4, 2 verify/decode
    steps = [r for r in rows if len(r) == 13 and r[0] != "| batch"]
    assert [r[0] for r in steps] == ["| 1", "| 3"]
    heads = next(r for r in rows if r[0] == "| batch" and len(r) == 13)
    assert heads[3:7] == ["verify k+1=2", "verify k+1=5", "varlen eager k+1=2",
                          "varlen eager k+1=5"]
    assert heads[9:11] == ["propose k=1", "propose k=4"]
    assert all(float(r[9]) > 0 and float(r[10]) > 0 for r in steps)
    assert "asks for decode graphs up to 15 rows" in report  # 3 × (4 + 1)
    assert "every verify cell ran eagerly (no decode CUDA graphs captured)" in report
    speedups = [r for r in rows if len(r) == 7 and r[0] != "| batch"]
    assert [(r[0], r[1]) for r in speedups] == [("| 1", "1"), ("| 1", "4"), ("| 3", "1"),
                                                ("| 3", "4")] * 2  # n-gram, then draft
    assert sum("(≥ 1.8)" in r[4] for r in speedups) == 2  # the batch-1 target, a=0.7, k=4
    measured = [r for r in rows if r[0] == "| ngram/grounded"]
    assert [r[3] for r in measured] == ["1", "4"]


def test_the_speculative_report_names_the_verify_cells_that_ran_eagerly() -> None:
    def times(batch: int, eager: tuple[int, ...]) -> speculative_verify.StepTimes:
        return speculative_verify.StepTimes(batch, 1.0, 1.0, {}, {}, 1.0, 1.0, {}, eager)

    cells = speculative_verify.eager_cells([times(8, ()), times(64, (5, 8))], True)
    assert cells.endswith("at: batch 64 k+1=5, batch 64 k+1=8")
    assert speculative_verify.eager_cells([times(8, ())], True) == (
        "every verify cell replayed a decode CUDA graph")


def test_the_shard_host_step_runs_without_a_forward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner

    (tmp_path / "config.json").write_text(json.dumps({**shard_step.QWEN3_8B_SHAPE,
                                                      **shard_step.TINY}))
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device="cpu", block_size=16,
                                     dtype="float32", load_format="dummy"))
    runner.warmup(1024, 1024, 8)
    assert 0 < shard_step.host_step_s(runner, 8, 16, steps=3, repeats=2) < 1.0
    assert len(runner.requests) == 0  # the run dropped its requests


def test_the_step_trace_times_each_hop_of_the_chain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Router and virtual shard (two processes) traced through the real servicer and
    # client; the hops of each step add up to its whole chain, and the shard's forward
    # is the virtual device's step.
    env = {**os.environ, "STEP_TRACE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.steps.router_step", "--requests", "4", "--new-tokens",
         "24",
         "--repeats", "1", "--modes", "engine", "--streaming", "no", "--device-ms", "5",
         "--shards", "grpc"], cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    router, shard = step_chain.read_trace(tmp_path)
    assert [size for _, _, size in router["send"]] == [4] * len(router["send"])
    assert len(shard["answer"]) == len(router["send"])  # every decode step answered
    assert len(shard["ready"]) == len(shard["answer"]) + len(shard["prefill"])
    assert {us for _, _, us in shard["answer"]} == {5000}
    steps = {step for step, _, _ in router["send"]}
    prefills = {step for step, _, _ in shard["prefill"]}
    for points, name in ((shard, "answer"), (router, "recv"), (router, "applied")):
        assert {step for step, _, _ in points[name]} == steps, name  # all numbered
    assert {step for step, _, _ in shard["ready"]} == steps | prefills
    times = step_chain.step_times(router, shard)
    rows = step_chain.hop_table(times, {s: 4 for s in times["send"]}, 4, in_flight=1)
    hops = [values for _, values in rows[:6]]  # ready → answer → ... → launched
    name, chain = rows[6]
    assert name.startswith("whole chain")
    assert len(chain) >= 15  # 23 decode steps less the last two, which have no k+2
    assert all(len(values) == len(chain) for values in hops)
    for k, total in enumerate(chain):
        assert sum(values[k] for values in hops) == pytest.approx(total, abs=1e-6)
        assert all(values[k] >= 0 for values in hops)
    # every step after the first carries the device's idle time before it, a prefill too
    assert prefills and not prefills & steps
    gapped = {step for step, _, _ in shard["device_gap"]}
    assert gapped == prefills | steps  # the virtual device knows its idle time before its first
    table = step_chain.idle_table(shard)
    counts = {line.split(" | ")[0][2:]: int(line.split(" | ")[1]) for line in table[4:]}
    decode_gaps = len(gapped - prefills)
    assert counts["decode"] == decode_gaps and counts["all"] == len(gapped)
    assert counts.get("prefill", 0) == len(gapped & prefills)


def test_the_locality_schedule_tells_the_allocators_apart() -> None:
    # cpu_serving.py's shape: prompts of 13-634 tokens, 64 new tokens, 8 in flight
    lens = [13, 14, 17, 24, 51, 171, 323, 633] * 3
    ours = block_locality.schedule_locality(lens, 8, 64, block_locality.BlockManager(4000, 16))
    fifo = block_locality.schedule_locality(lens, 8, 64,
                                            block_locality.FifoBlockManager(4000, 16))
    assert ours[0] > 0.9 and ours[1] < 0.1  # read in place, nothing gathered
    assert fifo[0] < 0.3 and fifo[1] > 0.7


def test_the_speculative_cpu_report_compares_off_and_on() -> None:
    exposition = ("# TYPE shardserve_spec_decode_proposed_tokens_total counter\n"
                  "shardserve_spec_decode_proposed_tokens_total 40.0\n"
                  "shardserve_spec_decode_accepted_tokens_total 30.0\n"
                  "shardserve_spec_decode_verify_step_duration_seconds_sum 0.5\n"
                  "shardserve_decode_step_wall_seconds_sum 0.25\n"
                  "shardserve_decode_step_duration_seconds_bucket{le=\"0.01\"} 7.0\n")
    counters = speculative_cpu.spec_counters(exposition)
    assert counters["spec_decode_proposed_tokens_total"] == 40
    assert counters["spec_decode_verify_step_duration_seconds_sum"] == 0.5
    assert counters["decode_step_wall_seconds_sum"] == 0.25
    assert sum(counters.values()) == 70.75  # no bucket, the absent ones 0
    same, other = speculative_cpu.Answer(["a", "b"], "ab"), speculative_cpu.Answer(["ab"], "ab")
    off = speculative_cpu.Run(2.0, [same, same], {
        **counters, "decode_step_duration_seconds_sum": 0.1,
        "decode_step_duration_seconds_count": 2.0, "decode_step_wall_seconds_sum": 0.12,
        "decode_step_wall_seconds_count": 2.0})
    # half of on's 20 decode steps speculate: 20 verifications of 2 guesses, 1.5 accepted
    on = speculative_cpu.Run(1.0, [same, other], {
        **counters, "spec_decode_verifications_total": 20.0,
        "spec_decode_verify_step_duration_seconds_count": 10.0,
        "decode_step_duration_seconds_count": 20.0, "decode_step_wall_seconds_sum": 1.8,
        "decode_step_wall_seconds_count": 20.0,
        "spec_decode_propose_step_duration_seconds_sum": 0.3,
        "spec_decode_propose_step_duration_seconds_count": 10.0})
    args = speculative_cpu.parse_args(["--workloads", "grounded-1", "--sweep", ""])
    report = speculative_cpu.report(args, {"grounded-1": off}, {"grounded-1": on},
                                    {"--ngram-min 1": {"grounded-1": on}})
    assert report.startswith("# Speculative decoding, n-gram guesses, ")
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ")]
    # 4 tokens in 2 s off, 3 in 1 s on; the answer tokenized otherwise is not identical
    spec = ["1.50×", "0.75", "1.50", "50.0", "0.05", "1/2 |"]
    assert rows[1] == ["| grounded", "1", "4", "2.0", "3.0", "50.0", *spec]
    assert [r[0] for r in rows[3:6]] == ["| (off: decode step 50.0 ms)", "| (defaults)",
                                         "| `--ngram-min 1`"]
    assert rows[5][2:] == spec
    # periods: 60 ms off, 90 ms on, so a speculative step's (90 - 0.5 x 60) / 0.5 = 120 ms
    # must emit 2 tokens: with 2 guesses, 1 + a + a^2 = 2 at a = 0.62
    cost = ["2.00", "50%", "50.0", "60.0", "30.0", "50.0", "120.0", "2.50", "2.00", "0.75",
            "0.62 |"]
    assert rows[7] == ["| grounded", "(defaults)", *cost]
    assert rows[8] == ["| grounded", "`--ngram-min 1`", *cost]


def test_the_speculative_cpu_report_names_a_draft_and_the_acceptance_a_step_needs() -> None:
    assert speculative_cpu.method("--speculative-model /tmp/draft-8 --speculative-model "
                                  "/tmp/draft-20") == "draft model draft-20"
    assert speculative_cpu.method("--speculative-method ngram") == "n-gram guesses"
    assert speculative_cpu.acceptance_for(1.5, 1) == pytest.approx(0.5)
    assert speculative_cpu.acceptance_for(2.7731, 4) == pytest.approx(0.7, abs=1e-4)
    assert speculative_cpu.acceptance_for(0.8, 4) == 0.0
    assert math.isnan(speculative_cpu.acceptance_for(5.5, 4))  # k + 1 = 5 at most
    plain = speculative_cpu.Run(1.0, [], {**dict.fromkeys(speculative_cpu.COUNTERS, 0.0),
                                          "decode_step_duration_seconds_count": 5.0})
    assert math.isnan(speculative_cpu.speculative_period_ms(plain, plain))  # none speculated
