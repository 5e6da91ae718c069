"""cuBLASLt's other algorithms for the model's products, against the one cuBLAS picks:
for each projection of the GPU benchmark's model (Llama-3-8B dimensions, vocabulary
49152, bf16) at each row count, every candidate of ``cublasLtMatmulAlgoGetHeuristic``
(:mod:`shard.kernels.cublaslt`) is checked against ``F.linear`` and timed in a CUDA graph
over distinct weight copies (streamed from HBM as in a step). Then the whole step's
products with the fastest candidate per shape against ``F.linear``, sustained at the
power cap (:mod:`benchmarks.kernels.step_energy`): the energy is what counts where the cap binds.
A script, not a test: prints markdown tables (device, versions, date).

    python -m benchmarks.kernels.gemm_algos --rows 256 16384 --seconds 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_power import PowerLog
from benchmarks.harness import header
from benchmarks.kernels.kernel_sweep import PROJECTIONS, _weights, graph_time_us
from benchmarks.kernels.step_energy import Work, measure
from shard.kernels import cublaslt, gemm_tuning

Product = Callable[[torch.Tensor, torch.Tensor], object]


def _loop(x: torch.Tensor, weights: list[torch.Tensor], fn: Product) -> Callable[[], None]:
    def run() -> None:
        for w in weights:
            fn(x, w)
    return run


Timed = list[tuple[float, cublaslt.Algorithm]]


def sweep(m: int, n: int, k: int, copies: int, limit: int, search: str,
          finalists: int = 6) -> tuple[float, Timed, list[str], int]:
    """``F.linear``'s µs per product, then (µs, algorithm) of the candidates that give
    ``F.linear``'s result (fastest first), notes on the rejected ones, and how many were
    screened. ``search``: ``heuristic`` times each of :func:`cublaslt.candidates` over
    ``copies`` weights; ``variants`` screens each of :func:`cublaslt.variants` over two
    copies, then times the ``finalists`` fastest (and the heuristic's first) over
    ``copies``; ``tuner`` runs the server's warm-up search
    (:func:`shard.kernels.gemm_tuning.tune_shape`), whose pick is kept only where it beats
    ``F.linear`` by its margin (else ``F.linear`` stays: no entry)."""
    weights = _weights(n, k, copies)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    base = graph_time_us(_loop(x, weights, F.linear)) / copies
    reference = F.linear(x, weights[0]).float()
    scale = reference.abs().max().item()
    notes: list[str] = []

    def product(algo: cublaslt.Algorithm) -> Product:
        return lambda a, w: cublaslt.matmul(a, w, algo)

    def time_all(algos: list[cublaslt.Algorithm], ws: list[torch.Tensor], reps: int) -> Timed:
        timed = []
        for algo in algos:
            try:
                err = (product(algo)(x, weights[0]).float() - reference).abs().max().item() / scale
                if err > 2e-2:
                    notes.append(f"{algo.describe()}: relative error {err:.1e}")
                    continue
                timed.append((graph_time_us(_loop(x, ws, product(algo)), reps) / len(ws), algo))
            except cublaslt.CublasLtError as e:
                notes.append(f"{algo.describe()}: {e}")
        return sorted(timed, key=lambda t: t[0])

    if search == "tuner":  # the server's own warm-up search (shard.kernels.gemm_tuning)
        result = gemm_tuning.tune_shape(m, weights)  # into no table: only measured
        best = [(result.best_us, result.algorithm)] if result.algorithm is not None else []
        return result.default_us, best, notes, result.screened
    if search == "heuristic":
        algos = cublaslt.candidates(m, n, k, limit=limit)
        timed = time_all(algos, weights, 10)
    else:
        algos = cublaslt.variants(m, n, k, limit=limit)
        screened = time_all(algos, weights[:2], 3)
        keep = [a for _, a in screened[:finalists]]
        keep += [a for a in algos[:1] if a not in keep]
        timed = time_all(keep, weights, 10)
    return base, timed, notes, len(algos)


def step_products(m: int, layers: int, choice: dict[str, cublaslt.Algorithm | None] | None,
                  weights: dict[str, list[torch.Tensor]], name: str, lm_head: bool) -> Work:
    """The products of ``layers`` layers (and the LM head if ``lm_head``: a decode step's,
    not a prefill's) at ``m`` rows, through ``F.linear`` (``choice`` None) or the chosen
    algorithm per projection (``F.linear`` where it is None)."""
    xs = {p: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for p, _, k in PROJECTIONS}
    outs = {p: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for p, n, _ in PROJECTIONS}

    def product(p: str, w: torch.Tensor) -> None:
        algo = None if choice is None else choice[p]
        if algo is None:
            torch.matmul(xs[p], w.t(), out=outs[p])
        else:
            cublaslt.matmul(xs[p], w, algo, out=outs[p])

    def run() -> None:
        for i in range(layers):
            for p in ("qkv", "o", "gate_up", "down"):
                product(p, weights[p][i])
        if lm_head:
            product("lm_head", weights["lm_head"][0])

    used = [(n, k, 1 if p == "lm_head" else layers) for p, n, k in PROJECTIONS
            if lm_head or p != "lm_head"]
    flops = 2.0 * m * sum(n * k * copies for n, k, copies in used)
    moved = 2.0 * sum((n * k + m * (n + k)) * copies for n, k, copies in used)
    return Work(name, run, flops, moved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 16384])
    p.add_argument("--copies", type=int, default=8, help="weight copies per timed graph")
    p.add_argument("--limit", type=int, default=64, help="candidates asked of the heuristic")
    p.add_argument("--search", choices=["heuristic", "variants", "tuner"], default="variants",
                   help="the heuristic's candidates only, every tile and cluster shape "
                        "around them, or the server's warm-up search")
    p.add_argument("--seconds", type=float, default=3.0, help="sustained loop per class (0: skip)")
    p.add_argument("--layers", type=int, default=32, help="layers of the sustained classes "
                   "(4 at 4096 rows or more)")
    args = p.parse_args()
    print(f"{header('cuBLASLt algorithms', 'cuda', 'torch')}, CUDA {torch.version.cuda}, "
          f"{Path(cublaslt._loaded_library_path()).name}\n")
    print("| rows | projection | F.linear µs | heuristic's first µs | best µs | best / F.linear "
          "| candidates | best (cuBLASLt config) |")
    print("|---:|---|---:|---:|---:|---:|---:|---|", flush=True)
    chosen: dict[int, dict[str, cublaslt.Algorithm | None]] = {}
    for m in args.rows:
        chosen[m] = {}
        for name, n, k in PROJECTIONS:
            copies = 1 if name == "lm_head" else args.copies
            base, timed, notes, screened = sweep(m, n, k, copies, args.limit, args.search)
            if not timed:
                if args.search == "tuner":
                    chosen[m][name] = None  # F.linear kept
                print(f"| {m} | {name} | {base:.1f} | — | — | — | {screened} | "
                      f"{'; '.join(notes)[:200] or 'F.linear kept'} |")
                continue
            first = next((us for us, a in timed if a.index == 0), float("nan"))
            best_us, best = timed[0]
            chosen[m][name] = best
            print(f"| {m} | {name} | {base:.1f} | {first:.1f} | {best_us:.1f} | "
                  f"{best_us / base:.3f} | {screened} | {best.describe()} |", flush=True)
            for note in notes[:3]:
                print(f"<!-- {m} {name} rejected: {note} -->")
    if args.seconds <= 0:
        return
    print("\n| class | ms per replay, start | ms per replay, sustained | rate | mean W | "
          "SM MHz p50 | at power cap | J per replay | energy per unit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with PowerLog(torch.cuda.current_device(), interval_ms=50) as log:
        for m in args.rows:
            decode = m < 4096
            if any(p not in chosen[m] for p, _, _ in PROJECTIONS if decode or p != "lm_head"):
                continue
            layers = args.layers if decode else 4
            weights = {name: _weights(n, k, 1 if name == "lm_head" else layers)
                       for name, n, k in PROJECTIONS}
            for choice, label in ((None, "F.linear"), (chosen[m], "best cuBLASLt"),
                                  (None, "F.linear again"), (chosen[m], "best cuBLASLt again")):
                work = step_products(m, layers, choice, weights, f"gemm{m} {label}", decode)
                print(measure(work, args.seconds, log), flush=True)
            del weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
