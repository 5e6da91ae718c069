"""Logic of benchmarks/serving/gpu_serving.py that needs no GPU: the workloads (the same requests
as the nano-vllm runner), decode-step means from the server's metrics, the weight bytes
of a checkpoint, the table's cells, and the request timeline read from the server's
log."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.gpu_power import HW_SLOWDOWN, SW_POWER_CAP, PowerLog, Sample, parse_sample
from benchmarks.harness import decode_step_means, metric_delta, percentile, scrape
from benchmarks.serving.completions_load import LoadRun
from benchmarks.serving.gpu_peers import HFRun, PeerError, run_nano_vllm
from benchmarks.serving.gpu_report import Report, Row, floor_line, power_table, render
from benchmarks.serving.random_checkpoint import weight_bytes
from benchmarks.serving.request_timeline import between, read_finished, split_runs, timeline
from benchmarks.serving.workloads import WORKLOAD_NAMES, Workload, build_workload, distinct_prefix
from router.metrics import Metrics

# Built with the runner's own ``workloads(49152)`` (nano_vllm_bench.py): requests, prompt
# tokens, output tokens, sha256 of json.dumps([prompts, output_lens]) (first 16 hex digits).
PEER_WORKLOADS = {
    "bench": (256, 142827, 133966, "199c6f016a1bff73"),
    "batch1": (1, 128, 256, "2b12849e1ce42d94"),
    "prefill_heavy": (512, 524288, 65536, "2f74fc4bbcc3cf47"),
    "decode_heavy": (256, 32768, 131072, "e26451e7d4990f5b"),
}


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_workloads_are_the_peer_runners(name: str) -> None:
    w = build_workload(name, 49152)
    digest = hashlib.sha256(json.dumps([w.prompts, w.output_lens]).encode()).hexdigest()
    assert (len(w.prompts), w.prompt_tokens, w.output_tokens, digest[:16]) == PEER_WORKLOADS[name]


def test_distinct_prefix_keeps_lengths_and_changes_every_first_id() -> None:
    w = build_workload("bench", 49152)
    moved = distinct_prefix(w, 49152)
    assert [len(p) for p in moved.prompts] == [len(p) for p in w.prompts]
    assert moved.output_lens == w.output_lens
    pairs = zip(moved.prompts, w.prompts, strict=True)
    assert all(a[0] != b[0] and a[1:] == b[1:] for a, b in pairs)
    assert distinct_prefix(Workload("w", [[9, 5]], [1]), 10).prompts == [[0, 5]]


def test_workload_head_and_description() -> None:
    w = build_workload("decode_heavy", 49152)
    assert w.describe() == "256 × 128 in / 512 out"
    assert w.head(3).describe() == "3 × 128 in / 512 out" and w.head(0) is w
    assert build_workload("bench", 49152).describe() == "256 × 107–1024 in / 103–1024 out"
    with pytest.raises(ValueError, match="valid: bench"):
        build_workload("nope", 10)


def test_decode_step_means_from_the_servers_exposition() -> None:
    state = dict(queue_size=0, running_batch_size=0, kv_blocks_total=1, kv_blocks_used=0,
                 prefix_cache_hit_tokens=0)
    metrics = Metrics(lambda: state)
    metrics.decode_step_wall.observe(1.0)  # before the run: must not count
    before = scrape(metrics.render().decode())
    for wall, forward in ((0.030, 0.025), (0.034, 0.027)):
        metrics.decode_step_wall.observe(wall)
        metrics.decode_step.observe(forward)
    state["prefix_cache_hit_tokens"] = 512
    delta = metric_delta(before, scrape(metrics.render().decode()))
    wall, forward = decode_step_means(delta)
    assert wall == pytest.approx(0.032) and forward == pytest.approx(0.026)
    assert delta["prefix_cache_hit_tokens_total"] == 512
    assert all(math.isnan(x) for x in decode_step_means({}))


def test_weight_bytes_leave_out_an_untied_embedding(tmp_path: Path) -> None:
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 6, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(4, dtype=torch.float32)}
    save_file(tensors, tmp_path / "model.safetensors")
    assert weight_bytes(tmp_path) == 10 * 4 * 2 + 4 * 6 * 2 + 4 * 4  # tied: embedding read
    save_file({"lm_head.weight": torch.zeros(10, 4, dtype=torch.bfloat16)},
              tmp_path / "model-2.safetensors")
    assert weight_bytes(tmp_path) == 10 * 4 * 2 + 4 * 6 * 2 + 4 * 4


def test_table_cells_ratios_missing_values_and_floor() -> None:
    batch1, decode = build_workload("batch1", 49152), build_workload("decode_heavy", 49152)
    ours_b1 = LoadRun(1, 256, 2.56, metrics={
        "decode_step_wall_seconds_sum": 2.55, "decode_step_wall_seconds_count": 255,
        "decode_step_duration_seconds_sum": 2.04, "decode_step_duration_seconds_count": 255})
    stream_b1 = LoadRun(1, 256, 2.6, ttft=[0.05], tpot=[0.0102])
    report = Report(rows={
        "batch1": Row(batch1, ours=ours_b1, latency=stream_b1,
                      nano={"requests": 1, "output_tokens": 256, "output_tok_per_s": 50.0},
                      hf=HFRun("batch1", 1, 1, 256, 12.8)),
        "decode_heavy": Row(decode, nano={"requests": 256, "output_tokens": 1000,
                                          "output_tok_per_s": 9000.0}),
    }, weight_bytes=6_000_000_000, copy_bw=3e12)
    text = render(report)
    row = next(line for line in text.splitlines() if line.startswith("| batch1"))
    assert row == ("| batch1 (1 × 128 in / 256 out) | 100 | 50 / 50 | 10.2 / 10.2 "
                   "| 10.0 / 8.0 | 50 | 2.00× | 20 (batch 1) | 5.00× |")
    row = next(line for line in text.splitlines() if line.startswith("| decode_heavy"))
    assert row == ("| decode_heavy (256 × 128 in / 512 out) | - | - | - | - | 9,000 ≠ | - "
                   "| - | - |")
    assert "nano-vllm ran 256 requests / 1000 output tokens, ours 256 / 131072" in text
    assert floor_line(report).endswith("= 2.000 ms; batch1 TPOT p50 10.20 ms = 5.1× the floor")
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and math.isnan(percentile([], 50))


FAKE_RUNNER = """
import json, os, sys, time
print("a line that is not JSON")
sys.stdout.buffer.write(b"not UTF-8: \\xff\\n")
print(json.dumps({"argv": sys.argv[1:], "pythonpath": os.environ["PYTHONPATH"]}))
for name in sys.argv[sys.argv.index("--workloads") + 1].split(","):
    print(json.dumps({"engine": "nano-vllm", "workload": name, "requests": 1,
                      "output_tokens": 256, "seconds": 2.0, "output_tok_per_s": 128.0}),
          flush=True)  # as the runner: each line as its workload ends
    time.sleep(0.3)
print("loading on stderr", file=sys.stderr)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def test_nano_vllm_runner_output_parsed_and_failure_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tmp_path / "runner.py"
    runner.write_text(FAKE_RUNNER)
    log = tmp_path / "logs" / "nano.log"
    args = (runner, tmp_path / "nano-vllm", "/site/fa", tmp_path / "ckpt",
            ["batch1", "bench"], log, 60.0)
    t0 = time.time()
    records = run_nano_vllm(*args)
    assert [r["workload"] for r in records] == ["batch1", "bench"]
    # each line stamped as it was read, not at the runner's exit
    assert t0 <= records[0]["ended_at"] < records[1]["ended_at"] <= time.time()
    assert records[1]["ended_at"] - records[0]["ended_at"] >= 0.25
    assert records[0]["output_tok_per_s"] == 128.0
    assert log.read_text() == "loading on stderr\n"
    seen = json.loads(log.with_suffix(".stdout").read_text().splitlines()[2])
    assert seen["argv"] == ["--model", str(tmp_path / "ckpt"), "--workloads", "batch1,bench"]
    assert seen["pythonpath"].split(os.pathsep)[:2] == ["/site/fa", str(tmp_path / "nano-vllm")]
    monkeypatch.setenv("FAKE_EXIT", "3")
    with pytest.raises(PeerError, match="exited with 3:\nloading on stderr"):
        run_nano_vllm(*args)
    monkeypatch.setenv("FAKE_SLEEP", "30")
    t0 = time.perf_counter()
    with pytest.raises(PeerError, match="timed out after 1s"):
        run_nano_vllm(*args[:-1], 1.0)
    assert time.perf_counter() - t0 < 15


FAKE_NVIDIA_SMI = """#!/bin/sh
# as nvidia-smi: the probe of power.draw.instant, then samples every -lms ms
case "$*" in
  *-lms*) ;;
  *) echo "${FAKE_INSTANT:-651.0}"; exit 0 ;;
esac
echo "$@" > "$(dirname "$0")/argv"
echo "2026/12/03 13:47:01.000, 650.5, 1620, 3201, 0x0000000000000004"
echo "2026/12/03 13:47:01.050, [N/A], 1980, 3201, 0x0000000000000000"
echo "2026/12/03 13:47:01.100, 450.0, 1980, 3201, 0x0000000000000001"  # idle, not capped
echo "a warning" >&2
exec sleep 60
"""

STAMP = datetime.datetime(2026, 12, 3, 13, 47, 1).timestamp()  # local time, as nvidia-smi's


def _fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "argv"


def _sample_until(log: PowerLog, n: int) -> None:
    deadline = time.time() + 10
    while len(log.samples) < n and time.time() < deadline:
        time.sleep(0.02)


def test_power_log_reads_nvidia_smi_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    log = PowerLog(index=1, interval_ms=50)
    assert log.start()
    _sample_until(log, 2)
    t0_stop = time.perf_counter()
    log.stop()
    assert time.perf_counter() - t0_stop < 5  # the sampler is terminated, not waited for
    args = argv.read_text()
    assert "-i 5 " in args and "-lms 50" in args  # CUDA device 1 is the machine's GPU 5
    assert "--query-gpu=timestamp,power.draw.instant,clocks.sm" in args
    assert log.errors == "a warning"
    assert [(s.t - STAMP, s.watts, s.sm_mhz, s.reasons) for s in log.samples] == [
        (0.0, 650.5, 1620.0, SW_POWER_CAP), (pytest.approx(0.1), 450.0, 1980.0, 1)]
    stats = log.window(STAMP, STAMP + 0.1)  # the [N/A] line skipped
    assert stats is not None
    assert (stats.samples, stats.mean_w, stats.max_w) == (2, 550.25, 650.5)
    assert (stats.sm_mhz_p50, stats.sm_mhz_min, stats.capped) == (1800.0, 1620.0, 0.5)
    assert stats.energy_j == pytest.approx(550.25 * 0.1)
    assert log.window(STAMP + 0.01, STAMP + 0.09) is None


def test_power_log_falls_back_to_the_averaged_power_and_needs_nvidia_smi(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_INSTANT", "[N/A]")  # a driver without power.draw.instant
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with PowerLog(index=2) as log:
        _sample_until(log, 2)
    assert "-i 2 " in argv.read_text()
    assert "--query-gpu=timestamp,power.draw,clocks.sm" in argv.read_text()
    assert log.power_field == "power.draw" and len(log.samples) == 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    missing = PowerLog()
    assert not missing.start()
    missing.stop()
    assert missing.window(0.0, time.time()) is None
    # a sampler that printed nothing is reported on stderr
    ran = tmp_path / "ran"  # one line per finished run: the probe, then the sampler
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho 'no GPU' >&2\necho x >> {ran}\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    quiet = PowerLog()
    assert quiet.start()
    deadline = time.time() + 10  # as a real nvidia-smi without a GPU, it ends by itself
    while (not ran.exists() or len(ran.read_text().split()) < 2) and time.time() < deadline:
        time.sleep(0.02)
    quiet.stop()
    assert "no samples from nvidia-smi (no GPU)" in capsys.readouterr().err


def test_power_sample_parsing() -> None:
    assert parse_sample("2026/12/03 13:47:01.250, 700.1, 1500, 3201, 0x000000000000000C") \
        == Sample(STAMP + 0.25, 700.1, 1500.0, 3201.0, SW_POWER_CAP | HW_SLOWDOWN)
    for bad in ["timestamp, power.draw [W], clocks.sm [MHz]", "1, 2, 3, 4",
                "2026/12/03 13:47:01.000, [N/A], 1, 2, 0x0", ""]:
        assert parse_sample(bad) is None


def test_power_table_per_engine_and_workload() -> None:
    w = Workload("decode_heavy", [[1] * 128] * 2, [500, 500])
    row = Row(w, ours=LoadRun(requests=2, output_tokens=1000, wall=1.0, started_at=100.0,
                              ended_at=101.0),
              nano={"workload": "decode_heavy", "requests": 2, "output_tokens": 1000,
                    "seconds": 2.0, "output_tok_per_s": 500.0, "ended_at": 205.0})
    log = PowerLog()
    # ours: 100-101 s at 700 W, capped; nano-vllm: 203-205 s at 600 W, half capped
    log.samples = [Sample(100.0 + i / 10, 700.0, 1600.0, 3201.0, SW_POWER_CAP)
                   for i in range(11)]
    log.samples += [Sample(203.0 + i / 10, 600.0, 1900.0, 3201.0, SW_POWER_CAP * (i % 2))
                    for i in range(20)]
    report = Report(rows={"decode_heavy": row}, power=log)
    text = render(report)
    assert ("| decode_heavy | 700 W, SM 1600 MHz, 100% | 0.700 | 600 W, SM 1900 MHz, 50% "
            "| 1.200 | 0.58× |") in text
    assert power_table(Report(rows={"decode_heavy": row})) == []


def _finish_line(stamp: str, rid: int, generated: int, ttft: float, e2e: float) -> str:
    # the router's line (router.engine.lifecycle, Lifecycle.finish) as loguru writes it
    return (f"{stamp} | INFO     | router.engine.lifecycle:finish:120 - request {rid} success: "
            f"prompt_tokens=128 generated_tokens={generated} finish_reason=length "
            f"queue_s=0.010 ttft_s={ttft} e2e_s={e2e:.3f}")


def test_request_timeline_from_the_router_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "2026-12-02 07:18:00.000 | INFO     | router.launcher:serve:230 - serving",
        # a run of three: arrivals at 10.0, 10.2, 10.4 s; first tokens at 10.5, 10.6, 11.0;
        # the last finishes at 15.0 s after 101 tokens
        _finish_line("2026-12-02 07:18:14.000", 7, 100, 0.5, 4.0),
        _finish_line("2026-12-02 07:18:14.700", 8, 100, 0.4, 4.5),
        _finish_line("2026-12-02 07:18:15.000", 9, 101, 0.6, 4.6),
        "2026-12-02 07:18:15.001 | INFO     | router.engine.lifecycle:finish:120 - request 10 "
        "cancelled: prompt_tokens=3 generated_tokens=0 finish_reason=None queue_s=0.0 "
        "ttft_s=None e2e_s=0.001",
        # another run 20 s later
        _finish_line("2026-12-02 07:18:40.000", 11, 10, 0.1, 1.0),
    ]) + "\n")
    finished = read_finished(log)
    assert [round(f.generated) for f in finished] == [100, 100, 101, 10]
    runs = split_runs(finished)
    assert [len(r) for r in runs] == [3, 1]
    t = timeline(runs[0])
    assert t is not None and t.requests == 3
    assert (round(t.arrivals_s, 3), round(t.last_first_token_s, 3),
            round(t.last_finish_s, 3)) == (0.4, 1.0, 5.0)
    assert t.decode_step_s == pytest.approx(4.0 / 100)
    assert t.tok_s == pytest.approx(301 / 5.0)
    assert "3 requests reached the engine over 0.40 s" in t.describe()
    # a run's window (epoch seconds of its first send and last completion) picks it
    start = finished[0].arrival - 0.05
    assert between(finished, start, finished[2].finish + 0.1) == finished[:3]
    assert timeline([]) is None
    # and the table's notes carry it
    report = Report(rows={"decode_heavy": Row(build_workload("decode_heavy", 49152),
                                              ours=LoadRun(3, 301, 5.2), timeline=t)})
    assert "decode_heavy, non-streaming pass (server log): 3 requests" in render(report)


def test_first_token_stalls_and_kernels_compiled_while_serving(tmp_path: Path) -> None:
    from benchmarks.serving.request_timeline import first_token_stalls, late_compiles

    log = tmp_path / "server.log"
    log.write_text("\n".join([
        # arrivals at 10.0, 10.0, 10.1, 13.0 s; first tokens at 10.2, 10.3, 11.0 (0.7 s
        # after the one before, with request 9 waiting since 10.1), then 13.1 (its request
        # arrived at 13.0: an idle gap, not a stall)
        _finish_line("2026-12-02 07:18:14.000", 7, 10, 0.2, 4.0),
        _finish_line("2026-12-02 07:18:14.000", 8, 10, 0.3, 4.0),
        _finish_line("2026-12-02 07:18:14.100", 9, 10, 0.9, 4.0),
        _finish_line("2026-12-02 07:18:14.000", 10, 10, 0.1, 1.0),
        "2026-12-02 07:18:10.5 | WARNING | shard rank=0 | shard.kernels.compile_watch:90 - "
        "Triton kernel _combine_kernel compiled while serving (a variant warm-up did not "
        "run; the step waited for it): _combine_kernel[num_warps=4](num_splits: i32)",
    ]) + "\n")
    finished = read_finished(log)
    assert [round(g, 3) for g in first_token_stalls(finished)] == [0.7]
    t = timeline(finished)
    assert t is not None and "stopped for ≥ 0.45 s while requests waited 1 times" in t.describe()
    assert late_compiles(log) == ["_combine_kernel"]
    quiet = tmp_path / "quiet.log"
    quiet.write_text(_finish_line("2026-12-02 07:18:14.000", 7, 10, 0.2, 4.0) + "\n")
    assert late_compiles(quiet) == [] and first_token_stalls(read_finished(quiet)) == []
