"""Kernel choices at the shapes of the GPU benchmark's model, on one GPU. A script, not a
test: prints markdown tables (device, versions, date).

Every sweep is timed as CUDA-graph replays (median of CUDA-event timings), the way a
server runs its decode step:

- GEMMs: every projection of one decoder layer of the Llama-3-8B-shaped model
  (``qkv``, ``o``, ``gate_up``, ``down``) and the LM head, at each ``--tokens`` count,
  through cuBLAS and through cuBLASLt (``torch.backends.cuda.preferred_blas_library``).
  Each graph runs ``--layers`` copies of the projection with distinct weights, so the
  weights stream from HBM as in a real step (one layer's weights fit in L2; 32 do not).
  Reported: µs per projection, weight bytes / time (TB/s), 2·M·N·K / time (TFLOP/s).
- decode attention (:func:`shard.kernels.attention.decode_attention`) at the
  model's heads (32 query, 8 KV, head dim 128, bf16, block size 16) over
  ``--decode-points`` (batch × context) for each tile / warps / stages configuration,
  with the split count the server's graphs use (``max_seqlen_k`` = ``--max-seqlen``).
- skinny GEMMs (``--skinny``): :func:`shard.kernels.skinny_gemm.skinny_linear`
  against cuBLAS at up to 16 tokens, per projection over a grid of tiles, warps and
  stages, then a chain of one layer's four projections over the layers.
- prefill attention (:func:`shard.kernels.attention.prefill_attention`) at the
  model's heads over ``--prefill-points`` (batch × new tokens, no cached prefix): keys
  from the paged cache and from the new K/V (``new_kv``) against flash-attn's varlen
  kernel, torch SDPA and torch's flash varlen kernel, then each tile / warps / stages
  configuration in both modes
  (not with ``--no-prefill-grid``).

Usage: python -m benchmarks.kernels.kernel_sweep [--tokens 1 256 16384] [--no-gemm]
       [--no-decode] [--decode-points 1x384 256x384 512x1100] [--quick-decode]
       [--block-sizes 16 64] [--inductor 256] [--prefill-points 16x1024 4x4096]
       [--skinny 1 4 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness import header
from benchmarks.kernels.paged_cases import PagedCase, make_case
from shard.kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    decode_attention,
    prefill_attention,
)
from shard.kernels.attention.decode import num_decode_splits
from shard.kernels.gate_up_silu import GateUpConfig, gate_up_silu
from shard.kernels.gate_up_silu import default_config as gate_up_default
from shard.kernels.silu_mul import silu_and_mul
from shard.kernels.skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    default_config,
    skinny_linear,
)

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 49152

# (name, out_features N, in_features K)
PROJECTIONS = [
    ("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    ("o", HIDDEN, HEADS * HEAD_DIM),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN),
    ("down", HIDDEN, INTERMEDIATE),
    ("lm_head", VOCAB, HIDDEN),
]


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one run on a side stream outside the capture
    (library handles, autotuning and Triton compiles happen there, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time_us(fn: Callable[[], object], reps: int = 10) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph. Unlike
    ``benchmarks/kernels/attention.py``'s ``bench`` it does not flush L2 between replays: the
    GEMM sweep streams its weights through distinct copies, and it times a fixed
    number of replays of graphs that can take a third of a second."""
    graph = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def _weights(n: int, k: int, copies: int) -> list[torch.Tensor]:
    """``copies`` distinct random bf16 ``[n, k]`` weights on the GPU (one per layer, so
    that a sweep streams them from HBM as a step does)."""
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(copies)]


def _linears(x: torch.Tensor, weights: list[torch.Tensor],
             fn: Callable[..., object] = F.linear) -> None:
    """``fn(x, w)`` for each of ``weights`` (a projection's copies, one per layer)."""
    for w in weights:
        fn(x, w)


def gemm_sweep(tokens: list[int], layers: int) -> list[str]:
    rows = ["| projection | tokens | cuBLAS µs | cuBLASLt µs | Lt / cuBLAS | best TB/s "
            "| best TFLOP/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    totals: dict[tuple[int, str], float] = {}
    for name, n, k in PROJECTIONS:
        copies = 1 if name == "lm_head" else layers
        weights = _weights(n, k, copies)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            per_lib = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)

                run = functools.partial(_linears, x, weights)
                per_lib[lib] = graph_time_us(run, reps=5 if m >= 4096 else 10) / copies
                scale = 1 if name == "lm_head" else layers
                totals[(m, lib)] = totals.get((m, lib), 0.0) + per_lib[lib] * scale
            torch.backends.cuda.preferred_blas_library("cublas")
            best = min(per_lib.values())
            rows.append(
                f"| {name} | {m} | {per_lib['cublas']:.1f} | {per_lib['cublaslt']:.1f} | "
                f"{per_lib['cublaslt'] / per_lib['cublas']:.3f} | "
                f"{n * k * 2 / best / 1e6:.2f} | {2 * m * n * k / best / 1e6:.0f} |")
            del x
        del weights
        torch.cuda.empty_cache()
    rows.append("")
    rows.append(f"Whole step ({layers} layers + LM head), ms:")
    rows.append("")
    rows.append("| tokens | cuBLAS | cuBLASLt | Lt / cuBLAS |")
    rows.append("|---:|---:|---:|---:|")
    for m in tokens:
        a, b = totals[(m, "cublas")] / 1e3, totals[(m, "cublaslt")] / 1e3
        rows.append(f"| {m} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return rows


def inductor_sweep(tokens: list[int], layers: int) -> list[str]:
    """Each projection through Inductor's GEMM autotuning (its Triton templates against
    cuBLAS, ``mode="max-autotune-no-cudagraphs"``), timed like :func:`gemm_sweep`."""
    rows = ["| projection | tokens | cuBLAS µs | Inductor autotuned µs | ratio |",
            "|---|---:|---:|---:|---:|"]
    for name, n, k in PROJECTIONS[:4]:
        weights = _weights(n, k, layers)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            base = graph_time_us(functools.partial(_linears, x, weights)) / layers
            auto = graph_time_us(functools.partial(_linears, x, weights, tuned)) / layers
            rows.append(f"| {name} | {m} | {base:.1f} | {auto:.1f} | {auto / base:.3f} |")
            torch._dynamo.reset()
        del weights
        torch.cuda.empty_cache()
    return rows


SKINNY_GRID = [SkinnyConfig(*c) for c in itertools.product((16, 32, 64), (128, 256, 512),
                                                            (4, 8), (3, 4, 5))]


def skinny_sweep(tokens: list[int], layers: int) -> list[str]:
    """:func:`shard.kernels.skinny_gemm.skinny_linear` against cuBLAS for each
    projection at each token count (<= ``MAX_ROWS``) over :data:`SKINNY_GRID`, timed like
    :func:`gemm_sweep`; then one decoder layer's four projections chained ``layers``
    times (the step's order of weights), cuBLAS against the best configuration of each."""
    rows = ["| projection | tokens | cuBLAS µs | default µs | best µs | best config "
            "(block_n, block_k, warps, stages) | best TB/s | best / cuBLAS |",
            "|---|---:|---:|---:|---:|---|---:|---:|"]
    weights = {name: _weights(n, k, 1 if name == "lm_head" else layers)
               for name, n, k in PROJECTIONS}
    best_config: dict[tuple[str, int], SkinnyConfig] = {}
    for (name, n, k), m in itertools.product(PROJECTIONS, [t for t in tokens if t <= MAX_ROWS]):
        ws = weights[name]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, ws[0]).float()
        base = graph_time_us(functools.partial(_linears, x, ws)) / len(ws)
        results = []
        for config in SKINNY_GRID:
            try:
                got = skinny_linear(x, ws[0], None, config,  # type: ignore[union-attr]
                                    pdl=True).float()
                kernel = functools.partial(skinny_linear, config=config, pdl=True)
                us = graph_time_us(functools.partial(_linears, x, ws, kernel)) / len(ws)
            except Exception as exc:  # a config that does not compile is skipped, named
                print(f"skipped {name} {m} {config}: {str(exc).splitlines()[0][:100]}")
                continue
            err = ((got - want).norm() / want.norm()).item()
            if not err < 1e-2:
                print(f"MISMATCH {name} {m} {config}: rel err {err:.2e}")
            results.append((us, config))
        results.sort()
        us, config = results[0]
        best_config[(name, m)] = config
        default = next((t for t, c in results if c == default_config(n, k)), float("nan"))
        rows.append(f"| {name} | {m} | {base:.1f} | {default:.1f} | {us:.1f} | "
                    f"{tuple(config)} | {n * k * 2 / us / 1e6:.2f} | {us / base:.3f} |")
    rows += ["", f"One layer's qkv, o, gate_up, down chained over {layers} layers (ms):", "",
             "| tokens | cuBLAS | skinny, best configs | skinny, default configs | best / cuBLAS |",
             "|---:|---:|---:|---:|---:|"]
    for m in [t for t in tokens if t <= MAX_ROWS]:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, _, k in PROJECTIONS}
        best = {name: best_config[(name, m)] for name, _, _ in PROJECTIONS[:4]}
        a, b, c = (graph_time_us(functools.partial(_chain, xs, weights, layers, configs,
                                                   skinny)) / 1e3
                   for configs, skinny in ((None, False), (best, True), (None, True)))
        rows.append(f"| {m} | {a:.3f} | {b:.3f} | {c:.3f} | {b / a:.3f} |")
    del weights
    torch.cuda.empty_cache()
    return rows


def _chain(xs: dict[str, torch.Tensor], weights: dict[str, list[torch.Tensor]], layers: int,
           configs: dict[str, SkinnyConfig] | None, skinny: bool) -> None:
    """One layer's four projections, ``layers`` times: cuBLAS, or the skinny kernel (with
    ``configs`` per projection, else the defaults)."""
    for i in range(layers):
        for name, _, _ in PROJECTIONS[:4]:
            if skinny:
                skinny_linear(xs[name], weights[name][i], None,
                              configs[name] if configs else None, pdl=True)
            else:
                F.linear(xs[name], weights[name][i])


# decode configurations swept: (block_n, num_warps, num_stages, target_programs)
FULL_GRID = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (132, 528, 2112)))
QUICK_GRID = list(itertools.product((64, 128), (4,), (3, 4), (528,)))


def decode_sweep(points: list[tuple[int, int]], max_seqlen: int, block_sizes: list[int],
                 grid: list[tuple[int, ...]], orders: tuple[bool, ...] = (True,),
                 layouts: tuple[str, ...] = ("permuted",)) -> list[str]:
    """Each configuration of ``grid`` in each launch order of ``orders`` (``heads_first``
    values; with both, each output is checked against the other order's), over block
    tables of each layout in ``layouts`` ("permuted": the cache's blocks in random order;
    "consecutive": each sequence's blocks consecutive)."""
    rows = ["| tables | block size | batch × ctx | block_n | warps | stages | target programs "
            "| splits | launch | µs | KV TB/s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for layout, block_size, (batch, ctx) in itertools.product(layouts, block_sizes, points):
        case = make_case([ctx] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM, block_size,
                         torch.bfloat16, "cuda", spare_blocks=0,
                         consecutive=layout == "consecutive")
        q, key, value = case.q, case.cache.key, case.cache.value
        tables, seq_lens = case.metadata.block_tables, case.metadata.seq_lens
        out = torch.empty_like(q)
        expected = decode_attention(q, key, value, tables, seq_lens, max_seqlen,
                                    HEAD_DIM ** -0.5, pdl=True).float()  # the default config
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        results = []
        for (block_n, warps, stages, target), first in itertools.product(grid, orders):
            config = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                  target_programs=target, heads_first=first)
            run = functools.partial(decode_attention, q, key, value, tables, seq_lens,
                                    max_seqlen, HEAD_DIM ** -0.5, out=out, config=config)
            try:
                us = graph_time_us(run)
            except Exception as exc:  # a config that does not compile is skipped, named
                print(f"skipped {batch}x{ctx} {config}: {str(exc).splitlines()[0][:100]}")
                continue
            error = (out.float() - expected).abs().max().item()
            if error > 2e-2:  # bf16 outputs of another summation order differ by ~1e-3
                print(f"MISMATCH {batch}x{ctx} {config}: max error {error:.3g}")
            if len(orders) > 1:
                got = out.clone()
                decode_attention(q, key, value, tables, seq_lens, max_seqlen,
                                 HEAD_DIM ** -0.5, out=out,
                                 config=dataclasses.replace(config, heads_first=not first),
                                 pdl=True)
                if not torch.equal(got, out):
                    print(f"MISMATCH launch orders {batch}x{ctx} {config}")
            splits = num_decode_splits(batch, KV_HEADS, max_seqlen, config)
            launch = "heads first" if first else "sequences first"
            results.append((us, block_n, warps, stages, target, splits, launch))
        results.sort()
        default = DecodeConfig()
        defaults = [r for r in results if r[1:5] == (default.block_n, default.num_warps,
                                                      default.num_stages,
                                                      default.target_programs)]
        shown = results[:6] + [r for r in defaults if r not in results[:6]]
        for us, block_n, warps, stages, target, splits, launch in shown:
            rows.append(f"| {layout} | {block_size} | {batch} × {ctx} | {block_n} | {warps} | "
                        f"{stages} | {target} | {splits} | {launch} | {us:.1f} | "
                        f"{kv_bytes / us / 1e6:.2f} |")
        del case, key, value
        torch.cuda.empty_cache()
    return rows


PREFILL_GRID = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))


def _prefill_inputs(batch: int, seq_len: int, block_size: int
                    ) -> tuple[PagedCase, tuple[object, ...], tuple[torch.Tensor, torch.Tensor]]:
    """A ``batch`` × ``seq_len`` prefill with no cached prefix: the case, the positional
    arguments of :func:`prefill_attention`, and (k, v) as views of one QKV buffer, as
    the server's new tokens lie in the projection's output."""
    case = make_case([seq_len] * batch, [seq_len] * batch, HEADS, KV_HEADS, HEAD_DIM,
                     block_size, torch.bfloat16, "cuda", spare_blocks=0)
    md = case.metadata
    args = (case.q, case.cache.key, case.cache.value, md.block_tables, md.cu_seqlens_q,
            md.seq_lens, md.max_seqlen_q, case.scale)
    qkv = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM)
    return case, args, (k, v)


def _prefill_flops(batch: int, seq_len: int) -> float:
    # causal: half of the score matrix, two matmuls (QK^T and PV) of 2 flops a term
    return 4 * batch * HEADS * HEAD_DIM * seq_len * (seq_len + 1) / 2


def prefill_sweep(points: list[tuple[int, int]], block_size: int, new_kv: bool) -> list[str]:
    """Every configuration of :data:`PREFILL_GRID` at each point; keys from the paged
    cache, or with ``new_kv`` from the new tokens' K/V as they are."""
    rows = ["| batch × tokens | keys from | block_m | block_n | warps | stages | µs | TFLOP/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    default = PrefillConfig()
    source = "new K/V" if new_kv else "paged cache"
    for batch, seq_len in points:
        case, args, kv = _prefill_inputs(batch, seq_len, block_size)
        out = torch.empty_like(case.q)
        flops = _prefill_flops(batch, seq_len)
        results = []
        for block_m, block_n, warps, stages in PREFILL_GRID:
            config = PrefillConfig(block_m=block_m, block_n=block_n, num_warps=warps,
                                   num_stages=stages)
            try:
                us = graph_time_us(functools.partial(prefill_attention, *args, out=out,
                                                     config=config,
                                                     new_kv=kv if new_kv else None), reps=5)
            except Exception as exc:  # a config that does not compile is skipped, named
                print(f"skipped {batch}x{seq_len} {config}: {str(exc).splitlines()[0][:100]}")
                continue
            results.append((us, block_m, block_n, warps, stages))
        results.sort()
        defaults = [r for r in results if r[1:] == (default.block_m, default.block_n,
                                                    default.num_warps, default.num_stages)]
        for us, block_m, block_n, warps, stages in results[:6] + [
                r for r in defaults if r not in results[:6]]:
            rows.append(f"| {batch} × {seq_len} | {source} | {block_m} | {block_n} | {warps} | "
                        f"{stages} | {us:.1f} | {flops / us / 1e6:.0f} |")
        del case, args, out, kv
        torch.cuda.empty_cache()
    return rows


def prefill_peers(points: list[tuple[int, int]], block_size: int) -> list[str]:
    """Our prefill kernel (default configuration) with keys from the paged cache and from
    the new K/V, against flash-attn's varlen kernel on the same new K/V (when
    ``flash_attn`` imports), torch SDPA on contiguous [batch, heads, tokens, dim]
    tensors (K/V heads repeated beforehand) and torch's own flash varlen kernel on the
    new K/V (with its largest difference from ours): µs (TFLOP/s). A peer that fails
    (a kernel this torch lacks, or one that cannot be captured in a graph) is named."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    rows = ["| batch × tokens | ours, paged cache | ours, new K/V | flash-attn varlen, new K/V "
            "| torch SDPA, contiguous | torch flash varlen, new K/V |",
            "|---|---:|---:|---:|---:|---:|"]
    for batch, seq_len in points:
        case, args, (k, v) = _prefill_inputs(batch, seq_len, block_size)
        md = case.metadata
        out = torch.empty_like(case.q)
        q4 = case.q.view(batch, seq_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        k4, v4 = (t.reshape(batch, seq_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
                  .repeat_interleave(HEADS // KV_HEADS, dim=1).contiguous() for t in (k, v))
        fns: list[Callable[[], object] | None] = [
            functools.partial(prefill_attention, *args, out=out),
            functools.partial(prefill_attention, *args, out=out, new_kv=(k, v)),
            None if flash_attn_varlen_func is None else functools.partial(
                flash_attn_varlen_func, case.q, k, v, md.cu_seqlens_q, md.cu_seqlens_q,
                seq_len, seq_len, softmax_scale=case.scale, causal=True),
            functools.partial(F.scaled_dot_product_attention, q4, k4, v4, scale=case.scale,
                              is_causal=True),
            functools.partial(_torch_flash_varlen, case.q, k, v, md.cu_seqlens_q, seq_len,
                              case.scale),
        ]
        flops = _prefill_flops(batch, seq_len)
        prefill_attention(*args, out=out, new_kv=(k, v), pdl=True)
        ours = out.clone()
        cells = []
        for fn in fns:
            try:
                us = None if fn is None else graph_time_us(fn, reps=5)
            except Exception as exc:  # a backend this torch or GPU lacks: named, skipped
                cells.append(f"n/a ({str(exc).splitlines()[0][:60]})")
                continue
            cell = "n/a" if us is None else f"{us:.1f} ({flops / us / 1e6:.0f})"
            if fn is fns[-1]:
                got = fn()
                cell += f", max diff vs ours {(got.float() - ours.float()).abs().max().item():.3g}"
            cells.append(cell)
        rows.append(f"| {batch} × {seq_len} | " + " | ".join(cells) + " |")
        del case, args, out, q4, k4, v4, k, v
        torch.cuda.empty_cache()
    return rows


def _torch_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """torch's own flash-attention varlen kernel (``_flash_attention_forward``), causal."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale)[0]


def _chunked(m: int, chunk: int) -> list[slice]:
    return [slice(i, min(i + chunk, m)) for i in range(0, m, chunk)]


def _mlp(x: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
         out: torch.Tensor, chunk: int) -> None:
    """gate_up → silu·mul (our kernel) → down for each layer's weights, ``chunk`` rows
    at a time (the intermediate of a chunk is written and read back while in L2)."""
    for wg, wd in zip(gate_up, down, strict=True):
        for rows in _chunked(x.shape[0], chunk):
            torch.matmul(silu_and_mul(F.linear(x[rows], wg), pdl=True), wd.t(), out=out[rows])


def _projection(x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor,
                chunk: int) -> None:
    for w in weights:
        for rows in _chunked(x.shape[0], chunk):
            torch.matmul(x[rows], w.t(), out=out[rows])


def eager_time_us(fn: Callable[[], object], reps: int = 3) -> float:
    """Median µs of ``fn`` run eagerly (launches from Python, as a prefill step runs)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def row_chunk_sweep(tokens: int, chunks: list[int], layers: int) -> list[str]:
    """A prefill of ``tokens`` rows: each projection, and the MLP (gate_up, silu·mul,
    down), over ``layers`` distinct weights, whole or ``chunk`` rows at a time, timed
    eagerly. Whole-step numbers (the four projections of every layer, the MLP with its
    silu·mul) come last."""
    rows = ["| op | chunk rows | µs per layer | TFLOP/s | vs whole |",
            "|---|---:|---:|---:|---:|"]
    dims = {name: (n, k) for name, n, k in PROJECTIONS}
    weights = {name: _weights(n, k, layers)
               for name, n, k in PROJECTIONS[:4]}
    x = {name: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
         for name, (n, k) in dims.items()}
    per: dict[tuple[str, int], float] = {}
    for name in ("qkv", "o", "gate_up", "down", "mlp"):
        if name == "mlp":
            out = torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * HIDDEN * INTERMEDIATE * 3
        else:
            n, k = dims[name]
            out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * n * k
        for chunk in chunks:
            if name == "mlp":
                fn = functools.partial(_mlp, x["gate_up"], weights["gate_up"], weights["down"],
                                       out, chunk)
            else:
                fn = functools.partial(_projection, x[name], weights[name], out, chunk)
            us = eager_time_us(fn) / layers
            per[(name, chunk)] = us
            rows.append(f"| {name} | {chunk} | {us:.1f} | {flops / us / 1e6:.0f} | "
                        f"{us / per[(name, chunks[0])]:.3f} |")
        del out
    rows += ["", f"Per prefill step of {tokens} tokens ({layers} layers: qkv + o + MLP), ms:",
             "", "| chunk rows | ms | vs whole |", "|---:|---:|---:|"]
    for chunk in chunks:
        total = sum(per[(name, chunk)] for name in ("qkv", "o", "mlp")) * layers / 1e3
        whole = sum(per[(name, chunks[0])] for name in ("qkv", "o", "mlp")) * layers / 1e3
        rows.append(f"| {chunk} | {total:.2f} | {total / whole:.3f} |")
    del weights, x
    torch.cuda.empty_cache()
    return rows


def _split_k(x: torch.Tensor, weights: list[torch.Tensor], splits: int) -> None:
    """``x @ w.T`` as a batched product over ``splits`` slices of K, then their sum."""
    m, k = x.shape
    part = k // splits
    xs = x.view(m, splits, part).transpose(0, 1)  # [splits, m, part]
    for w in weights:
        n = w.shape[0]
        ws = w.as_strided((splits, part, n), (part, 1, k))  # [splits, part, n] of w.T
        torch.bmm(xs, ws).sum(0)


def split_k_sweep(tokens: list[int], layers: int) -> list[str]:
    """Each projection as ``F.linear`` (cuBLAS's own choice) against a batched product over
    2 or 4 slices of K and their sum (more tiles for the under-filled shapes)."""
    rows = ["| projection | tokens | cuBLAS µs | split 2 µs | split 4 µs | best / cuBLAS |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, n, k in PROJECTIONS[:4]:
        weights = _weights(n, k, layers)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            base = graph_time_us(functools.partial(_linears, x, weights)) / layers
            split = []
            for s in (2, 4):
                xs = x.view(m, s, k // s).transpose(0, 1)
                got = torch.bmm(xs, weights[0].as_strided((s, k // s, n), (k // s, 1, k)))
                err = ((got.float().sum(0) - want).norm() / want.norm()).item()
                if not err < 1e-2:
                    print(f"MISMATCH split-K {name} {m} {s}: rel err {err:.2e}")
                split.append(graph_time_us(functools.partial(_split_k, x, weights, s)) / layers)
            rows.append(f"| {name} | {m} | {base:.1f} | {split[0]:.1f} | {split[1]:.1f} | "
                        f"{min(split) / base:.3f} |")
        del weights
        torch.cuda.empty_cache()
    return rows


GATE_UP_GRID = [GateUpConfig(*c) for c in itertools.product((64, 128), (64, 128), (64, 128),
                                                             (4, 8), (3, 4))]
# up to the skinny kernel's 16 rows: one 16-row tile, the skinny kernel's column blocks
# and K slices
GATE_UP_SKINNY_GRID = [GateUpConfig(16, *c) for c in itertools.product(
    (16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 5))]


def _gate_up_chain(x: torch.Tensor, weights: list[torch.Tensor],
                   config: GateUpConfig | None) -> None:
    """Each layer's gate/up with SwiGLU as the server ran it before the fused kernel
    (``config`` None: the skinny kernel up to 16 rows, else cuBLAS; then our silu·mul
    kernel), or the fused kernel with ``config``."""
    for w in weights:
        if config is None:
            product = skinny_linear(x, w, None, pdl=True) if x.shape[0] <= 16 else None
            silu_and_mul(product if product is not None else F.linear(x, w), pdl=True)
        else:
            gate_up_silu(x, w, config, min_rows=1, max_rows=1 << 20, pdl=True)


def gate_up_sweep(tokens: list[int], layers: int) -> list[str]:
    """:func:`shard.kernels.gate_up_silu.gate_up_silu` against cuBLAS + our silu·mul
    kernel at each token count, over :data:`GATE_UP_GRID`, timed like :func:`gemm_sweep`
    (``layers`` distinct weights); every configuration's output checked against the
    unfused path."""
    rows = ["| tokens | unfused (skinny up to 16 rows, else cuBLAS) + silu·mul µs | "
            "default µs | best µs | best config (block_m, "
            "block_n, block_k, warps, stages) | best / unfused |",
            "|---:|---:|---:|---:|---|---:|"]
    n, k = 2 * INTERMEDIATE, HIDDEN
    weights = _weights(n, k, layers)
    for m in tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = silu_and_mul(F.linear(x, weights[0]), pdl=True).float()
        base = graph_time_us(functools.partial(_gate_up_chain, x, weights, None)) / layers
        results = []
        for config in GATE_UP_SKINNY_GRID if m <= 16 else GATE_UP_GRID:
            try:
                got = gate_up_silu(x, weights[0], config, min_rows=1, max_rows=1 << 20,
                                   pdl=True)
                assert got is not None
                us = graph_time_us(functools.partial(_gate_up_chain, x, weights, config)) / layers
            except Exception as exc:  # a config that does not compile is skipped, named
                print(f"skipped gate_up {m} {config}: {str(exc).splitlines()[0][:100]}")
                continue
            err = ((got.float() - want).norm() / want.norm()).item()
            if not err < 1e-2:
                print(f"MISMATCH gate_up {m} {config}: rel err {err:.2e}")
            results.append((us, config))
        results.sort()
        us, config = results[0]
        default = next((t for t, c in results if c == gate_up_default(m)), float("nan"))
        rows.append(f"| {m} | {base:.1f} | {default:.1f} | {us:.1f} | {tuple(config)} | "
                    f"{us / base:.3f} |")
        del x
    del weights
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 512, 16384])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--inductor", type=int, nargs="*", default=None, metavar="TOKENS",
                   help="also autotune each projection with Inductor at these token counts")
    p.add_argument("--decode-points", nargs="+", default=["1x384", "256x384", "512x1100"],
                   help="BATCHxCONTEXT points of the decode sweep")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16],
                   help="KV block sizes of the decode sweep")
    p.add_argument("--both-orders", action="store_true",
                   help="sweep the decode kernel in both launch orders (DecodeConfig.heads_first)")
    p.add_argument("--quick-decode", action="store_true",
                   help=f"only the decode configurations {QUICK_GRID}")
    p.add_argument("--prefill-points", nargs="*", default=None, metavar="BATCHxTOKENS",
                   help="also sweep the prefill kernel's configurations at these points "
                   "(e.g. 16x1024 4x4096)")
    p.add_argument("--no-prefill-grid", action="store_true",
                   help="at --prefill-points, only our default configuration and the peers")
    p.add_argument("--skinny", type=int, nargs="*", default=None, metavar="TOKENS",
                   help="also time the skinny GEMM kernel's configurations against cuBLAS "
                   f"at these token counts (<= {MAX_ROWS}, e.g. 1 4 16)")
    p.add_argument("--row-chunks", type=int, nargs="*", default=None, metavar="ROWS",
                   help="also time a --prefill-tokens prefill's projections and MLP whole "
                   "(first value = that count) and in chunks of these row counts")
    p.add_argument("--prefill-tokens", type=int, default=16384)
    p.add_argument("--gate-up", type=int, nargs="*", default=None, metavar="TOKENS",
                   help="also time the fused gate/up + SwiGLU kernel's configurations against "
                   "cuBLAS + silu·mul at these token counts")
    p.add_argument("--split-k", type=int, nargs="*", default=None, metavar="TOKENS",
                   help="also time each projection as a batched product over K slices")
    p.add_argument("--tables", nargs="+", choices=["permuted", "consecutive"],
                   default=["permuted"], help="decode block-table layouts to time")
    p.add_argument("--max-seqlen", type=int, default=4096,
                   help="max_seqlen_k the server's graphs are captured with")
    args = p.parse_args()
    print(f"{header('kernel sweep', 'cuda', 'torch', 'triton')}, CUDA {torch.version.cuda}")
    if not args.no_gemm:
        print("\n## GEMMs\n")
        print("\n".join(gemm_sweep(args.tokens, args.layers)), flush=True)
    if args.inductor:
        print("\n## GEMMs: Inductor's autotuned Triton templates against cuBLAS\n")
        print("\n".join(inductor_sweep(args.inductor, args.layers)), flush=True)
    if args.skinny:
        print("\n## Skinny GEMM kernel against cuBLAS\n")
        print("\n".join(skinny_sweep(args.skinny, args.layers)), flush=True)
    if args.row_chunks:
        print(f"\n## Prefill of {args.prefill_tokens} tokens in row chunks (eager)\n")
        chunks = [args.prefill_tokens] + [c for c in args.row_chunks if c != args.prefill_tokens]
        print("\n".join(row_chunk_sweep(args.prefill_tokens, chunks, args.layers)), flush=True)
    if args.gate_up:
        print("\n## Fused gate/up + SwiGLU against cuBLAS + silu·mul\n")
        print("\n".join(gate_up_sweep(args.gate_up, args.layers)), flush=True)
    if args.split_k:
        print("\n## GEMMs as batched split-K products\n")
        print("\n".join(split_k_sweep(args.split_k, args.layers)), flush=True)
    if args.prefill_points:
        points = [tuple(int(v) for v in s.split("x")) for s in args.prefill_points]
        print("\n## Prefill attention: keys from the cache or the new K/V, and peers\n")
        print("µs (TFLOP/s); our kernel in its default configuration\n")
        print("\n".join(prefill_peers(points, args.block_sizes[0])), flush=True)  # type: ignore[arg-type]
        if not args.no_prefill_grid:
            print("\n## Prefill attention configurations (fastest six, then the default)\n")
            for new_kv in (False, True):
                print("\n".join(prefill_sweep(points, args.block_sizes[0], new_kv)),  # type: ignore[arg-type]
                      flush=True)
    if not args.no_decode:
        points = [tuple(int(v) for v in s.split("x")) for s in args.decode_points]
        print("\n## Decode attention (fastest six, then the default)\n")
        grid = QUICK_GRID if args.quick_decode else FULL_GRID
        orders = (False, True) if args.both_orders else (DecodeConfig().heads_first,)
        print("\n".join(decode_sweep(points, args.max_seqlen, args.block_sizes, grid,  # type: ignore[arg-type]
                                      orders, tuple(args.tables))),
              flush=True)


if __name__ == "__main__":
    main()
