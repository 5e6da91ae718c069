"""Where a decode step's GPU time goes: the kernels of ``ModelRunner.decode`` (CUDA graph
replay, sampling, copies) under ``torch.profiler``, per step, at each batch size; with
``--prefill SEQS LEN``, those of one prefill as well (with the ``triton`` backend twice:
the flash varlen path it takes for prompts with no cached prefix, then its paged kernel).

A Qwen3-architecture config with Llama-3-8B dimensions (hidden 4096, 32 layers, 32/8
heads, head dim 128, intermediate 14336, vocabulary 49152) and dummy bf16 weights; every
request has a ``--prompt-len``-token random prompt. Prints, per batch size, the median
step (wall, host included) and the kernels sorted by GPU time per step, as markdown.

    python -m benchmarks.kernels.decode_profile --batch 1 256 --top 20 --prefill 16 1024
    python -m benchmarks.kernels.decode_profile --device cpu --small --batch 1 4   # logic check
    python -m benchmarks.kernels.decode_profile --batch 1 8 --no-skinny   # A/B: cuBLAS at 1-16
    python -m benchmarks.kernels.decode_profile --batch 1 256 --pdl both   # A/B: PDL on and off

Besides the wall step, each batch size gets the captured graph's replay alone (CUDA
events around 50 back-to-back replays): the device time of the forward, gaps between its
kernels included, which is what programmatic dependent launch (``--pdl``) can shorten.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.gpu_power import PowerLog, PowerStats
from benchmarks.harness import header
from benchmarks.steps.dummy_model import BLOCK, QWEN3_8B_SHAPE, SMALL, prefill_requests
from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.pending_step import PendingStep


def _kernel_table(prof: torch.profiler.profile, steps: int, top: int,
                  title: str) -> list[str]:
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name]
            entry[0] += event.device_time_total  # µs
            entry[1] += 1
    total = sum(us for us, _ in per_kernel.values()) / steps or float("nan")
    lines = [f"### {title}, {total / 1e3:.3f} ms of kernels per step", "",
             "| kernel | per step | µs per step | share |", "|---|---:|---:|---:|"]
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    for name, (us, count) in ranked[:top]:
        lines.append(f"| `{name[:90]}` | {count / steps:.0f} | {us / steps:.1f} "
                     f"| {us / steps / total:.1%} |")
    return lines


_ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def profile_batch(runner: ModelRunner, batch: int, prompt_len: int, steps: int,
                  top: int, pipelined: int = 0) -> str:
    """Markdown: median wall step and the top kernels by GPU time per decode step; with
    ``pipelined``, that many more steps launched as the server launches them, timed on
    the device, then the replay alone over as many replays, each with the GPU's clocks
    and power while it ran (:class:`benchmarks.gpu_power.PowerLog`)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    prefill_requests(runner, batch, prompt_len, steps * 2 + 6 + pipelined)
    for _ in range(4):
        runner.decode()
    walls = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        runner.decode()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    with torch.profiler.profile(activities=_ACTIVITIES) as prof:
        for _ in range(steps):
            runner.decode()
        sync()
    replay = replay_ms(runner, batch)
    extra: list[str] = []
    if pipelined and runner.device.type == "cuda":
        extra = ["", "| loop | ms per step (device) | per-step timer p50 / p90 | SM MHz p50 "
                 "(min) | power W mean (max) | samples at the power cap |",
                 "|---|---:|---:|---:|---:|---:|"]
        with PowerLog(torch.cuda.current_device()) as log:
            t0 = time.time()
            mean, timers = pipelined_steps(runner, pipelined)
            t1 = time.time()
            again = replay_ms(runner, batch, reps=pipelined)
            t2 = time.time()
        deciles = statistics.quantiles(timers, n=10)
        extra.append(f"| pipelined launch_decode/finish_step | {mean:.3f} | "
                     f"{deciles[4]:.3f} / {deciles[8]:.3f} | {_power_cells(log.window(t0, t1))} |")
        extra.append(f"| graph replay alone (final contexts) | {again:.3f} | — | "
                     f"{_power_cells(log.window(t1, t2))} |")
    runner.reset()
    title = (f"decode, batch {batch}: step {statistics.median(walls):.3f} ms wall, "
             f"graph replay {replay:.3f} ms")
    return "\n".join(_kernel_table(prof, steps, top, title) + extra) + "\n"


def _power_cells(stats: PowerStats | None) -> str:
    if stats is None:
        return "— | — | —"
    return (f"{stats.sm_mhz_p50:.0f} ({stats.sm_mhz_min:.0f}) | {stats.mean_w:.0f} "
            f"({stats.max_w:.0f}) | {stats.capped:.0%}")


def pipelined_steps(runner: ModelRunner, steps: int) -> tuple[float, list[float]]:
    """``steps`` decode steps launched as the shard's servicer launches them (step k+1
    before step k's tokens are read, so the device never waits for the host): device ms
    per step from CUDA events around the loop, and each step's own timer (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    pending = runner.launch_decode()
    timers = []
    for _ in range(steps - 1):
        following = runner.launch_decode()
        assert isinstance(pending, PendingStep)
        timers.append(runner.finish_step(pending).forward_ns / 1e6)
        pending = following
    assert isinstance(pending, PendingStep)
    timers.append(runner.finish_step(pending).forward_ns / 1e6)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps, timers


def replay_ms(runner: ModelRunner, batch: int, reps: int = 50) -> float:
    """Device ms per replay of the decode graph of ``batch``'s bucket (NaN without
    graphs), on the static inputs of the last decode step."""
    if runner.graphs is None or runner.graphs.bucket_for(batch) is None:
        return float("nan")
    runner.graphs.replay(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        runner.graphs.replay(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def profile_prefill(runner: ModelRunner, seqs: int, prompt_len: int, top: int,
                    trace: Path | None = None) -> str:
    """Markdown: one prefill of ``seqs`` prompts of ``prompt_len`` tokens (best wall of
    3, then profiled once) and its top kernels, then the device's idle time between
    them; with ``trace``, the profile as a Chrome trace there."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    walls = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        prefill_requests(runner, seqs, prompt_len, 8, per=seqs)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
        runner.reset()
    with torch.profiler.profile(activities=_ACTIVITIES) as prof:
        prefill_requests(runner, seqs, prompt_len, 8, per=seqs)
        sync()
    runner.reset()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    tokens = seqs * prompt_len
    title = (f"prefill, {seqs} × {prompt_len} tokens: {min(walls):.1f} ms wall, "
             f"{tokens / min(walls):.0f} tokens/ms")
    return "\n".join(_kernel_table(prof, 1, top, title) + _idle_table(prof)) + "\n"


def _idle_table(prof: torch.profiler.profile, top: int = 8) -> list[str]:
    """The device's idle time between its first and last kernel, and the longest gaps
    with the kernel after each (the host was late to launch it)."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return []
    gaps, busy_until = [], kernels[0][1]
    for start, end, name in kernels[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, name))
        busy_until = max(busy_until, end)
    span = busy_until - kernels[0][0]
    idle = sum(g for g, _ in gaps)
    lines = ["", f"Device idle between kernels: {idle / 1e3:.2f} ms of {span / 1e3:.2f} ms "
             f"({len(gaps)} gaps); the longest:", "", "| gap µs | kernel after it |",
             "|---:|---|"]
    for gap, name in sorted(gaps, reverse=True)[:top]:
        lines.append(f"| {gap:.0f} | `{name[:90]}` |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--prefill", type=int, nargs=2, default=None, metavar=("SEQS", "LEN"),
                   help="also profile one prefill of SEQS prompts of LEN tokens")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cuda-graphs", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a small config instead of 8B")
    p.add_argument("--no-skinny", action="store_true",
                   help="without the skinny GEMM kernel (cuBLAS at every batch size; gate/up "
                        "at 1-128 rows keeps the fused gate/up + SwiGLU kernel), for A/B")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="write the prefill profile as a Chrome trace (with --prefill)")
    p.add_argument("--pipelined", type=int, default=0, metavar="STEPS",
                   help="also time STEPS decode steps launched as the server launches "
                        "them, and as many graph replays, with the GPU's clocks and power")
    p.add_argument("--pdl", choices=["on", "off", "both"], default="on",
                   help="our kernels with programmatic dependent launch (where it runs), "
                        "without, or both in turn (graphs captured again), for A/B")
    args = p.parse_args()
    if args.pipelined == 1:
        p.error("--pipelined needs at least 2 steps (0: off)")
    run(args)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        shape = {**QWEN3_8B_SHAPE, **SMALL, "architectures": ["Qwen3ForCausalLM"],
                 "model_type": "qwen3"} if args.small else QWEN3_8B_SHAPE
        Path(folder, "config.json").write_text(json.dumps(shape))
        runner = ModelRunner(ShardConfig(
            model_path=folder, device=args.device, block_size=BLOCK,
            dtype="bfloat16" if args.device == "cuda" else "float32",
            gpu_memory_fraction=0.85, load_format="dummy",
            attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
        ))
        prefill_tokens = args.prefill[0] * args.prefill[1] if args.prefill else 0
        if args.no_skinny:
            runner.kernels.skinny_linear = None
        modes = ["on", "off"] if args.pdl == "both" else [args.pdl]
        with pdl_mode(runner, modes[0]):
            runner.warmup(max(8192, prefill_tokens), 8192, max(args.batch))
        for i, mode in enumerate(modes):
            with pdl_mode(runner, mode):
                if i and runner.graphs is not None:
                    runner.graphs.capture()
                on = pdl_on(runner)
                print(header(f"decode step kernels, backend {runner.backend.name}, skinny "
                             f"GEMM kernels {'off' if args.no_skinny else 'on'}, "
                             f"programmatic dependent launch {'on' if on else 'off'}",
                             args.device, "torch") + "\n")
                if on:
                    print("(with programmatic dependent launch a kernel's time includes "
                          "its wait for the one before it: compare the graph replay "
                          "times)\n")
                for batch in args.batch:
                    print(profile_batch(runner, batch, args.prompt_len, args.steps,
                                        args.top, args.pipelined))
                if args.prefill:
                    trace = args.trace
                    if trace is not None and len(modes) > 1:
                        trace = trace.with_name(f"{trace.stem}-pdl-{mode}{trace.suffix}")
                    print(profile_prefill(runner, *args.prefill, args.top, trace))


@contextlib.contextmanager
def pdl_mode(runner: ModelRunner, mode: str) -> Iterator[None]:
    """Inside the block the runner's kernels launch with programmatic dependent launch
    as it chose at start-up (``on``: where it runs) or without (``off``)."""
    chosen = runner.kernels.pdl
    runner.kernels.pdl = chosen and mode == "on"
    try:
        yield
    finally:
        runner.kernels.pdl = chosen


def pdl_on(runner: ModelRunner) -> bool:
    return runner.kernels.pdl


if __name__ == "__main__":
    main()
