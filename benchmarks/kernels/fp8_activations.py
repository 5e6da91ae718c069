"""Activations quantized for an fp8 product, fused into the op before it against
quantized after it, on one GPU. A script, not a test: prints a markdown table (device,
versions, date).

The two ops a decoder layer runs before its products, at the Llama-3-8B shapes (hidden
4096, intermediate 14336), at each ``--rows`` count:

- ``add_rms_norm``: the residual add and RMSNorm before ``qkv_proj`` / ``gate_up_proj``;
- ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` before ``down_proj``.

For each: the op alone, writing its rows in bfloat16 (what a bf16 model runs); unfused,
the op then :func:`shard.quantization.fp8.quantize_rows` (compiled, as ``fp8_linear``
quantizes its input today); fused, our kernel writing e4m3 rows and their scales
(:func:`shard.kernels.rms_norm.add_rms_norm_fp8`,
:func:`shard.kernels.silu_mul.silu_and_mul_fp8`). Each is timed as CUDA-graph replays of
``--copies`` calls in a row (median of ``--reps`` CUDA-event timings, divided by the
calls), launched with PDL where it runs, as the server's decode graphs run them. GB/s:
the fused kernel's bytes read and written over its time.

``--device cpu`` runs the same calls under Triton's interpreter, timed by the wall clock:
a check that the script runs, not a measurement.

Usage: python -m benchmarks.kernels.fp8_activations [--rows 1 8 64 256 4096]
       [--hidden 4096] [--intermediate 14336] [--copies 20] [--reps 20] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.harness import header

EPS = 1e-5


def _graph_us(fn: Callable[[], object], copies: int, reps: int) -> float:
    """Median µs of one call of ``fn``: ``copies`` calls captured in one CUDA graph
    (:func:`benchmarks.kernels.kernel_sweep.graph_time_us`), each replay's time over
    ``copies``."""
    # NOTE: imported here: kernel_sweep imports our kernels, which must not be decorated
    # before main() sets TRITON_INTERPRET on a CPU
    from benchmarks.kernels.kernel_sweep import graph_time_us

    def calls() -> None:
        for _ in range(copies):
            fn()

    return graph_time_us(calls, reps) / copies


def _wall_us(fn: Callable[[], object], copies: int, reps: int) -> float:
    """Median wall-clock µs of one call of ``fn`` (CPU: the interpreter)."""
    fn()
    times = []
    for _ in range(max(1, reps // 4)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _cases(
    rows: int, hidden: int, intermediate: int, device: str, pdl: bool
) -> list[tuple[str, int, dict[str, Callable[[], object]], int]]:
    """(op, width, {"op": ..., "unfused": ..., "fused": ...}, bytes the fused kernel moves)
    for ``rows`` tokens."""
    from shard.kernels.rms_norm import add_rms_norm, add_rms_norm_fp8
    from shard.kernels.silu_mul import silu_and_mul, silu_and_mul_fp8
    from shard.quantization.fp8 import quantize_rows

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(device, torch.bfloat16)
    residual = torch.randn(rows, hidden, generator=gen).to(device, torch.bfloat16)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen).to(device, torch.bfloat16)

    def norm_unfused() -> object:
        result = add_rms_norm(x, residual, weight, EPS, pdl=pdl)
        assert result is not None
        return quantize_rows(result[0])

    def silu_unfused() -> object:
        return quantize_rows(silu_and_mul(gate_up, pdl=pdl))

    # bytes: norm reads x, residual, weight and writes the sum, e4m3 rows and scales;
    # SwiGLU reads gate and up and writes e4m3 rows and scales
    norm_bytes = rows * hidden * (2 + 2 + 2 + 1) + hidden * 2 + rows * 4
    silu_bytes = rows * intermediate * (2 + 2 + 1) + rows * 4
    return [
        (
            "add_rms_norm",
            hidden,
            {
                "op": lambda: add_rms_norm(x, residual, weight, EPS, pdl=pdl),
                "unfused": norm_unfused,
                "fused": lambda: add_rms_norm_fp8(x, residual, weight, EPS, pdl=pdl),
            },
            norm_bytes,
        ),
        (
            "silu_and_mul",
            intermediate,
            {
                "op": lambda: silu_and_mul(gate_up, pdl=pdl),
                "unfused": silu_unfused,
                "fused": lambda: silu_and_mul_fp8(gate_up, pdl=pdl),
            },
            silu_bytes,
        ),
    ]


def run(
    rows_list: list[int], hidden: int, intermediate: int, copies: int, reps: int, device: str
) -> list[str]:
    """The table's lines (markdown), each printed as it is measured."""
    from shard.kernels import pdl as launch

    on_gpu = device.startswith("cuda")
    pdl = on_gpu and launch.available(torch.device(device))
    timer = _graph_us if on_gpu else _wall_us
    lines = [
        header("fp8 activations: fused vs op + quantize_rows", device, "torch", "triton"),
        "",
        f"bfloat16 inputs, PDL {'on' if pdl else 'off'}, {copies} calls per graph"
        if on_gpu
        else "CPU: Triton's interpreter, wall clock (a logic check only)",
        "",
        "| op | width | rows | op alone µs (bf16 out) | op + quantize_rows µs "
        "| fused µs | unfused / fused | fused GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for rows in rows_list:
        for name, width, fns, nbytes in _cases(rows, hidden, intermediate, device, pdl):
            us = {key: timer(fn, copies, reps) for key, fn in fns.items()}
            lines.append(
                f"| {name} | {width} | {rows} | {us['op']:.2f} | {us['unfused']:.2f} "
                f"| {us['fused']:.2f} | {us['unfused'] / us['fused']:.2f} "
                f"| {nbytes / (us['fused'] * 1e-6) / 1e9:.0f} |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--copies", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="timed replays")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (logic check)")
    args = p.parse_args()
    if args.device.startswith("cuda"):
        capability = torch.cuda.get_device_capability(args.device)
        if capability < (8, 9):
            raise SystemExit(
                f"fp8 conversions need compute capability 8.9+, this GPU has "
                f"{capability[0]}.{capability[1]}"
            )
        torch.cuda.set_device(torch.device(args.device).index or 0)
    else:
        # before the kernels are imported (run imports them): Triton reads it at jit time
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run(args.rows, args.hidden, args.intermediate, args.copies, args.reps, args.device)


if __name__ == "__main__":
    main()
