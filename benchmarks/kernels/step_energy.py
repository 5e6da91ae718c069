"""Power and energy of a decode step's kernel classes on one GPU, sustained: each class is
captured in a CUDA graph and replayed back to back for ``--seconds`` while
:class:`benchmarks.gpu_power.PowerLog` samples the board's power and clocks. A script,
not a test: prints one markdown table (device, versions, date).

Where the board's power cap binds, a step runs at the clock its kernels' power allows,
so which kernels draw the power tells what a faster step needs (less energy, not only
less time at full clock). Classes, at the shapes of the GPU benchmark's model
(Llama-3-8B dimensions, vocabulary 49152, bf16):

- ``gemm256``: a 256-row decode step's projections (``qkv``, ``o``, ``gate_up``,
  ``down`` of 32 layers with distinct weights, and the LM head), cuBLAS;
- ``attention256``: 32 layers of decode attention at 256 sequences × 384 tokens (our
  Triton kernel, block size 16);
- ``step256``: both, layer by layer (``qkv``, attention, ``o``, ``gate_up``, ``down``),
  the mix of a 256-row step less its norms and activations;
- ``gemm256 through cuBLASLt``: the same products captured with
  ``torch.backends.cuda.preferred_blas_library("cublaslt")`` (other kernels, other energy);
- ``gemm16384``: a 16384-token prefill's projections over 4 layers;
- ``read256``: the bytes of ``attention256`` read by a plain Triton kernel (a running
  max): the energy per byte of the reads alone, the floor of any decode attention;
- ``copy``: a 2 GiB device-to-device copy (bandwidth-bound reference).

Reported per class: ms per replay at the start (median of the first replays) and
sustained (mean over the loop), its rate (TFLOP/s of the products, or TB/s of the bytes
the class must move), mean power, SM clock p50, the share of samples at the power cap,
joules per replay, and picojoules per FLOP or per byte.

    python -m benchmarks.kernels.step_energy --seconds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.gpu_power import PowerLog, PowerStats
from benchmarks.harness import header
from benchmarks.kernels.kernel_sweep import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PROJECTIONS,
    _weights,
    capture_graph,
)
from benchmarks.kernels.paged_cases import PagedCase, make_case
from shard.kernels.attention import DecodeConfig, decode_attention


@dataclass
class Work:
    """One class: what a replay runs, and the FLOPs and the bytes it must move."""

    name: str
    run: Callable[[], object]
    flops: float
    bytes: float
    blas: str = "cublas"  # the BLAS library the graph is captured with


def _replays_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Mean ms per replay over ``reps`` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure(work: Work, seconds: float, log: PowerLog) -> str:
    """The markdown row of ``work``: replayed for ``seconds`` after a pause of 2 s (the
    board cools to its idle draw), power from the loop's last three quarters."""
    torch.backends.cuda.preferred_blas_library(work.blas)
    try:
        graph = capture_graph(work.run)
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    time.sleep(2.0)
    first = statistics.median(_replays_ms(graph, 1) for _ in range(5))
    reps = max(5, int(seconds * 1e3 / first))
    t0 = time.time()
    sustained = _replays_ms(graph, reps)
    t1 = time.time()
    del graph
    return _row(work, f"{work.name} | {first:.3f}", sustained, log.window(t0 + (t1 - t0) / 4, t1))


def _row(work: Work, name_and_start: str, ms: float, stats: PowerStats | None) -> str:
    """The markdown row of ``work`` at ``ms`` per run with the power ``stats`` of its loop
    (``name_and_start``: the name cell, then the start column's cell)."""
    rate = (f"{work.flops / ms / 1e9:.0f} TFLOP/s" if work.flops
            else f"{work.bytes / ms / 1e9:.2f} TB/s")
    head = f"| {name_and_start} | {ms:.3f} | {rate} |"
    if stats is None:
        return head + " — |" * 5
    joules = stats.mean_w * ms / 1e3
    per = (f"{joules / work.flops * 1e12:.2f} pJ/FLOP" if work.flops
           else f"{joules / work.bytes * 1e12:.1f} pJ/B")
    return (f"{head} {stats.mean_w:.0f} | {stats.sm_mhz_p50:.0f} | {stats.capped:.0%} | "
            f"{joules:.3f} | {per} |")


def _projection_weights(layers: int) -> dict[str, list[torch.Tensor]]:
    return {name: _weights(n, k, 1 if name == "lm_head" else layers)
            for name, n, k in PROJECTIONS}


def _gemm_work(name: str, rows: int, layers: int, weights: dict[str, list[torch.Tensor]],
               lm_head: bool) -> Work:
    inputs = {p: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
              for p, _, k in PROJECTIONS}

    def run() -> None:
        for i in range(layers):
            for p, _, _ in PROJECTIONS[:4]:
                F.linear(inputs[p], weights[p][i])
        if lm_head:
            F.linear(inputs["lm_head"], weights["lm_head"][0])

    used = [(n, k, 1 if name == "lm_head" else layers) for name, n, k in PROJECTIONS
            if lm_head or name != "lm_head"]
    flops = sum(2.0 * rows * n * k * copies for n, k, copies in used)
    moved = sum(2.0 * (n * k + rows * (n + k)) * copies for n, k, copies in used)
    return Work(name, run, flops, moved)


def _attention_variants(specs: list[str]) -> list[tuple[int, DecodeConfig]]:
    out = []
    for spec in specs:
        block_size, block_n, warps, stages = (int(v) for v in spec.split(":"))
        out.append((block_size, DecodeConfig(block_n=block_n, num_warps=warps,
                                             num_stages=stages)))
    return out


def _kv_bytes(batch: int, ctx: int, layers: int) -> float:
    """K and V bytes (bf16) a decode step reads over ``layers`` layers."""
    return 2.0 * batch * ctx * KV_HEADS * HEAD_DIM * 2 * layers


def _case(batch: int, ctx: int, block_size: int) -> PagedCase:
    return make_case([ctx] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM, block_size,
                     torch.bfloat16, "cuda", spare_blocks=0, consecutive=True)


def decode_layer(batch: int, ctx: int, block_size: int,
                 config: DecodeConfig | None = None) -> Callable[[], None]:
    """One layer's decode attention (our kernel, ``config`` or the defaults) over
    ``batch`` sequences of ``ctx`` tokens in ``block_size``-token KV blocks."""
    case = _case(batch, ctx, block_size)
    meta, out = case.metadata, torch.empty_like(case.q)

    def attend() -> None:
        decode_attention(case.q, case.cache.key, case.cache.value, meta.block_tables,
                         meta.seq_lens, 4096, HEAD_DIM ** -0.5, out=out, config=config,
                         pdl=True)

    return attend


def attention_work(name: str, batch: int, ctx: int, layers: int, block_size: int,
                   config: DecodeConfig | None = None) -> Work:
    """``layers`` launches of our decode kernel (:func:`decode_layer`)."""
    attend = decode_layer(batch, ctx, block_size, config)

    def run() -> None:
        for _ in range(layers):
            attend()

    return Work(name, run, 0.0, _kv_bytes(batch, ctx, layers))


@triton.jit
def _read_max(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """out[program] = max of its TILES × BLOCK elements of x (bf16 read, float32 max)."""
    program = tl.program_id(0)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for tile in range(TILES):
        offsets = (program * TILES + tile) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=float("-inf"))
        acc = tl.maximum(acc, x.to(tl.float32))
    tl.store(out_ptr + program, tl.max(acc, 0))


def read_work(batch: int, ctx: int, layers: int, block_size: int) -> Work:
    """A plain read of the bytes ``attention_work`` reads (each layer's K and V of the
    same cache, in order, a running max kept per program): the memory system's energy
    per byte with the least work around it, the floor any decode attention pays."""
    case = _case(batch, ctx, block_size)
    parts = [case.cache.key.view(-1), case.cache.value.view(-1)]
    block, tiles = 4096, 16
    programs = triton.cdiv(parts[0].numel(), block * tiles)
    out = torch.empty(programs, device="cuda", dtype=torch.float32)

    def run() -> None:
        for _ in range(layers):
            for x in parts:
                _read_max[(programs,)](x, out, x.numel(), BLOCK=block, TILES=tiles,
                                      num_warps=8)

    return Work(f"read{batch} (K/V bytes of attention{batch}, SM loads)", run, 0.0,
                2.0 * parts[0].numel() * 2 * layers)


def flash_attention_work(batch: int, ctx: int, layers: int) -> Work:
    """flash-attn's paged decode over 256-token blocks (its paged API's multiple)."""
    from flash_attn import flash_attn_with_kvcache

    case = _case(batch, ctx, 256)
    meta, q = case.metadata, case.q.unsqueeze(1)

    def run() -> None:
        for _ in range(layers):
            flash_attn_with_kvcache(q, case.cache.key, case.cache.value,
                                    cache_seqlens=meta.seq_lens, block_table=meta.block_tables,
                                    softmax_scale=HEAD_DIM ** -0.5, causal=True)

    return Work(f"attention{batch}, flash-attn, block 256", run, 0.0,
                _kv_bytes(batch, ctx, layers))


def sm_limited(work: Work, sms: list[int], seconds: float, log: PowerLog) -> list[str]:
    """Rows of ``work`` run eagerly on a green context's stream of each SM count in
    ``sms`` (``torch.cuda.green_contexts``): does a bandwidth-bound class keep its rate on
    fewer SMs, and at what power?"""
    from torch.cuda.green_contexts import GreenContext

    rows = []
    for n in sms:
        ctx = GreenContext.create(num_sms=n, device_id=torch.cuda.current_device())
        stream = ctx.Stream()
        with torch.cuda.stream(stream):
            work.run()
            torch.cuda.synchronize()
            time.sleep(2.0)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            one = torch.cuda.Event(enable_timing=True)
            one.record(stream)
            work.run()
            end.record(stream)
            end.synchronize()
            reps = max(5, int(seconds * 1e3 / one.elapsed_time(end)))
            t0 = time.time()
            start.record(stream)
            for _ in range(reps):
                work.run()
            end.record(stream)
            end.synchronize()
            t1 = time.time()
        rows.append(_row(work, f"{work.name} on {n} SMs (eager) | —",
                         start.elapsed_time(end) / reps, log.window(t0 + (t1 - t0) / 4, t1)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="sustained loop per class")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--attention-configs", nargs="*", default=[],
                   metavar="BS:BLOCK_N:WARPS:STAGES",
                   help="more decode attention classes: KV block size and launch parameters")
    p.add_argument("--sm-limits", type=int, nargs="*", default=[],
                   help="also run the attention class eagerly on green contexts of these "
                        "SM counts")
    p.add_argument("--only", nargs="*", default=[],
                   help="only the classes whose names contain one of these")
    p.add_argument("--flash-attn", action="store_true",
                   help="also flash-attn's paged decode (flash_attn_with_kvcache, 256-token "
                        "blocks) over the same contexts")
    args = p.parse_args()
    print(f"{header('step energy', 'cuda', 'torch', 'triton')}, CUDA {torch.version.cuda}\n")
    batch, ctx, layers = args.batch, args.context, args.layers
    weights = _projection_weights(layers)
    gemms = _gemm_work(f"gemm{batch}", batch, layers, weights, lm_head=True)
    attend = decode_layer(batch, ctx, 16)
    attention = attention_work(f"attention{batch}", batch, ctx, layers, 16)
    variants = [attention_work(f"attention{batch}, block {block_size}, tiles {config.block_n}"
                               f"/{config.num_warps}/{config.num_stages}", batch, ctx, layers,
                               block_size, config)
                for block_size, config in _attention_variants(args.attention_configs)]
    flash = flash_attention_work(batch, ctx, layers) if args.flash_attn else None
    xs = {p: torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
          for p, _, k in PROJECTIONS}

    def step() -> None:
        for i in range(layers):
            F.linear(xs["qkv"], weights["qkv"][i])
            attend()
            for name in ("o", "gate_up", "down"):
                F.linear(xs[name], weights[name][i])
        F.linear(xs["lm_head"], weights["lm_head"][0])

    mixed = Work(f"step{batch}", step, gemms.flops, gemms.bytes + attention.bytes)
    src = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = Work("copy", lambda: dst.copy_(src), 0.0, 2.0 * src.numel() * 2)
    prefill = _gemm_work("gemm16384", 16384, 4, weights, lm_head=False)
    lt = dataclasses.replace(gemms, name=f"gemm{batch} through cuBLASLt", blas="cublaslt")
    print("| class | ms per replay, start | ms per replay, sustained | rate | mean W | "
          "SM MHz p50 | at power cap | J per replay | energy per unit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with PowerLog(torch.cuda.current_device(), interval_ms=50) as log:
        classes = [gemms, lt, attention, *variants, *([flash] if flash else []),
                   read_work(batch, ctx, layers, 16), mixed, prefill, copy]
        for work in classes if not args.only else [c for c in classes
                                                     if any(o in c.name for o in args.only)]:
            print(measure(work, args.seconds, log), flush=True)
        if args.sm_limits:
            print("\n".join(sm_limited(attention, args.sm_limits, args.seconds, log)),
                  flush=True)


if __name__ == "__main__":
    main()
