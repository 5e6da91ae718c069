"""Batch-1 linear layers on the GPU: cuBLAS (``F.linear``) against our Triton GEMV
(:mod:`shard.layers.gemv_kernel`) at each launch configuration, for the projections of
an 8B-shaped model (hidden 4096, 32/8 heads of 128, intermediate 14336).

Each variant runs 32 times in one CUDA graph, as in a decode step, cycling through
enough weight copies that the L2 cache holds none of them; the time per call is the
graph's replay time (CUDA events, median of 20) / 32. Checks each Triton result against
``F.linear`` first. Prints a markdown table with the bandwidth (weight bytes / time) as
a share of the copy bandwidth measured in the same run.

    python benchmarks/gemv.py
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.layers.gemv_kernel import GemvConfig, gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
CALLS = 32


def _graph_time(fn: Callable[[int], torch.Tensor], copies: int) -> float:
    """Seconds per call of ``fn(i)`` replayed in a CUDA graph of CALLS calls."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % copies)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def _row(name: str, n: int, k: int, configs: list[GemvConfig], bandwidth: float) -> str:
    nbytes = n * k * 2
    copies = max(2, (256 << 20) // nbytes + 1)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for config in configs[:3]:
        err = (gemv(x, weights[0], config=config).float()
               - F.linear(x, weights[0]).float()).abs().max().item()
        assert err < 2e-2, f"{name} {config}: max error {err}"
    cublas = _graph_time(lambda i: F.linear(x, weights[i]), copies)
    best = min(((_graph_time(lambda i, c=c: gemv(x, weights[i], config=c), copies), c)
                for c in configs), key=lambda timed: timed[0])
    return (f"| {name} | {n} × {k} | {cublas * 1e6:.1f} ({nbytes / cublas / bandwidth:.0%}) "
            f"| {best[0] * 1e6:.1f} ({nbytes / best[0] / bandwidth:.0%}) | {best[1]} |")


def main() -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    configs = [GemvConfig(bn, bk, w) for bn, bk, w in
               itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8))]
    print(f"# batch-1 GEMV, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {bandwidth / 1e12:.3f} TB/s\n")
    print("| layer | N × K | cuBLAS µs (% copy bw) | best Triton µs (% copy bw) | config |")
    print("|---|---|---:|---:|---|")
    for name, (n, k) in SHAPES.items():
        print(_row(name, n, k, configs, bandwidth))

if __name__ == "__main__":
    main()
