"""Prefill products through the cuBLASLt algorithm measured fastest at warm-up.

cuBLAS's heuristic picks one kernel per product shape; at prefill sizes another tile or
cluster shape is sometimes faster (``benchmarks/results/kernels-h200.md``, "cuBLASLt's
other algorithms"). At warm-up :func:`tune` times, for each weight shape ``[n, k]`` of
the model's linear layers, ``F.linear`` and every algorithm of
:func:`shard.layers.cublaslt.variants` at prefill row counts (the prefill token budget,
then halves of it down to :data:`MIN_ROWS`), over the model's own weights of that shape
(several layers' copies, streamed from HBM as in a step). An algorithm faster than
``F.linear`` by more than :data:`MARGIN` is kept for that shape and row count; a product
of ``m`` rows then runs through the one kept at the largest tuned row count ``<= m``
(:func:`lookup`), if cuBLASLt accepts it for ``m`` rows. Decode steps (fewer rows than
:data:`MIN_ROWS`) are left to cuBLAS: there its pick was the fastest measured.

The choice is per process (each tensor-parallel rank tunes its own shards) and holds
until :func:`clear`. A tuned product differs from ``F.linear``'s by the float32
accumulation order of another kernel (bfloat16 or float16 only).

Source of the method: PyTorch's TunableOp (``torch.cuda.tunable``), which times every
BLAS implementation registered for a GEMM shape and keeps the fastest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shard.layers import cublaslt

MIN_ROWS = 4096  # fewer rows: decode steps and short prefills, left to cuBLAS
MARGIN = 0.01  # an algorithm is kept only if at least 1% faster than F.linear
FINALISTS = 4  # variants timed again over several weights after the screening
TIMED_WEIGHTS = 4  # weights of a shape a finalist is timed over

_table: dict[tuple[int, int, torch.dtype], list[tuple[int, cublaslt.Algorithm]]] = {}
_accepted: dict[tuple[int, int, int, torch.dtype, bytes], bool] = {}


@dataclass(frozen=True)
class TunedProduct:
    """What :func:`tune` measured for one weight shape at one row count.

    Attributes:
        rows, n, k: the product ``[rows, k] @ [n, k].T``.
        default_us: ``F.linear``'s µs per product.
        best_us: the fastest cuBLASLt variant's µs per product.
        algorithm: that variant, or None where none beat ``F.linear`` by :data:`MARGIN`
            (then ``F.linear`` stays).
        screened: how many variants were timed.
    """

    rows: int
    n: int
    k: int
    default_us: float
    best_us: float
    algorithm: cublaslt.Algorithm | None
    screened: int

    def describe(self) -> str:
        pick = self.algorithm.describe() if self.algorithm else "F.linear kept"
        return (f"[{self.rows}, {self.k}] x [{self.n}, {self.k}]: F.linear "
                f"{self.default_us:.0f} µs, best of {self.screened} variants "
                f"{self.best_us:.0f} µs: {pick}")


def row_counts(max_rows: int) -> list[int]:
    """The row counts tuned for a prefill budget of ``max_rows`` tokens: ``max_rows``,
    then halves down to :data:`MIN_ROWS` (none below it)."""
    counts = []
    rows = max_rows
    while rows >= MIN_ROWS:
        counts.append(rows)
        rows //= 2
    return counts


def _time_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int) -> float:
    """Fastest of ``reps`` timings (CUDA events) of ``fn`` over ``weights``, µs per product."""
    fn(weights[0])
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for w in weights:
            fn(w)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(weights))
    return best


def tune_shape(rows: int, weights: list[torch.Tensor]) -> TunedProduct:
    """Time ``F.linear`` and the cuBLASLt variants for ``[rows, k] @ w.T`` over
    ``weights`` (same shape ``[n, k]``, dtype and device) and record the fastest
    variant if it beats ``F.linear`` by :data:`MARGIN`.

    Raises:
        cublaslt.CublasLtError: if cuBLASLt's heuristic fails for this shape.
    """
    n, k = weights[0].shape
    dtype, device = weights[0].dtype, weights[0].device
    timed = weights[:TIMED_WEIGHTS]
    x = torch.randn(rows, k, dtype=dtype, device=device)
    out = torch.empty(rows, n, dtype=dtype, device=device)
    default_us = _time_us(lambda w: torch.matmul(x, w.t(), out=out), timed, reps=3)
    index = device.index or 0

    def through(algo: cublaslt.Algorithm) -> Callable[[torch.Tensor], object]:
        return lambda w: cublaslt.matmul(x, w, algo, out)

    def screen(algos: list[cublaslt.Algorithm]) -> list[tuple[float, cublaslt.Algorithm]]:
        timings = []
        for algo in algos:
            try:
                timings.append((_time_us(through(algo), timed[:1], reps=1), algo))
            except cublaslt.CublasLtError:
                continue
        return sorted(timings, key=lambda t: t[0])

    # two stages: every tile with each candidate's own cluster shape, then the cluster
    # shapes of the fastest tiles (a seventh of screening every tile with every shape)
    tiles = screen(cublaslt.variants(rows, n, k, dtype, device=index, clusters=()))
    shaped = [v for _, a in tiles[:2 * FINALISTS]
              for v in cublaslt.cluster_variants(rows, n, k, dtype, a, index)[1:]]
    screened = sorted(tiles + screen(shaped), key=lambda t: t[0])
    finalists = screened[:FINALISTS]
    best_us, best = float("inf"), None
    for _, algo in finalists:
        us = _time_us(through(algo), timed, reps=3)
        if us < best_us:
            best_us, best = us, algo
    keep = best if best is not None and best_us < default_us * (1 - MARGIN) else None
    if keep is not None:
        entries = [e for e in _table.get((n, k, dtype), []) if e[0] != rows]
        _table[(n, k, dtype)] = sorted([*entries, (rows, keep)], key=lambda e: -e[0])
    return TunedProduct(rows, n, k, default_us, best_us, keep, len(screened))


def tune(weights: Iterable[torch.Tensor], max_rows: int, log: Any = None) -> list[TunedProduct]:
    """Tune every distinct weight shape among ``weights`` (2-D CUDA bfloat16 or float16
    tensors; others are skipped) at :func:`row_counts` of ``max_rows``; log each result
    and the time taken when ``log`` (a loguru logger) is given.

    Returns:
        what was measured, one entry per shape and row count.
    """
    by_shape: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for w in weights:
        if w.dim() == 2 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) \
                and w.is_contiguous():
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    started = time.perf_counter()
    results: list[TunedProduct] = []
    try:
        cublaslt.library()
    except (OSError, AttributeError) as e:  # no libcublasLt, or one without these calls
        if log is not None:
            log.warning("prefill products left to cuBLAS: cuBLASLt not usable here ({})", e)
        return results
    for rows in row_counts(max_rows):
        for shape_weights in by_shape.values():
            try:
                results.append(tune_shape(rows, shape_weights))
            except cublaslt.CublasLtError as e:
                if log is not None:
                    log.warning("cuBLASLt tuning of {} rows x {} skipped: {}", rows,
                                tuple(shape_weights[0].shape), e)
            if log is not None and results:
                log.info("prefill product {}", results[-1].describe())
    torch.cuda.empty_cache()
    if log is not None:
        log.info("tuned {} prefill product shapes in {:.1f} s ({} through cuBLASLt)",
                 len(results), time.perf_counter() - started,
                 sum(r.algorithm is not None for r in results))
    return results


def lookup(m: int, n: int, k: int, dtype: torch.dtype) -> cublaslt.Algorithm | None:
    """The tuned algorithm for ``[m, k] @ [n, k].T``: the one kept at the largest tuned
    row count ``<= m``, if cuBLASLt accepts it for ``m`` rows; else None (use
    ``F.linear``)."""
    if m < MIN_ROWS:
        return None
    entries = _table.get((n, k, dtype))
    if not entries:
        return None
    algo = next((a for rows, a in entries if rows <= m), None)
    if algo is None:
        return None
    key = (m, n, k, dtype, algo.raw)
    accepted = _accepted.get(key)
    if accepted is None:
        accepted = cublaslt.accepts(m, n, k, dtype, algo)
        if len(_accepted) > 4096:
            _accepted.clear()
        _accepted[key] = accepted
    return algo if accepted else None


def clear() -> None:
    """Forget every tuned choice (products go back to ``F.linear``)."""
    _table.clear()
    _accepted.clear()


def tuned() -> bool:
    """Whether any product shape runs through a tuned algorithm."""
    return bool(_table)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` through the tuned algorithm for its shape, or None where
    there is none (2-D contiguous CUDA ``x`` only)."""
    if x.dim() != 2 or not x.is_contiguous() or not weight.is_contiguous():
        return None
    algo = lookup(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)
    if algo is None:
        return None
    out = cublaslt.matmul(x, weight, algo)
    return out if bias is None else out.add_(bias)
