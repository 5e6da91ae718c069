"""Products through the cuBLASLt algorithm measured fastest at warm-up.

cuBLAS's heuristic picks one kernel per product shape; another tile or cluster shape is
often faster, at prefill sizes and at decode batch sizes alike
(``benchmarks/results/kernels-h200.md``, "cuBLASLt's other algorithms"). At warm-up
:func:`tune` times, for each weight shape ``[n, k]`` of the model's linear layers,
``F.linear`` and the algorithms of :func:`shard.kernels.cublaslt.variants` over the
model's own weights of that shape (several layers' copies, streamed from HBM as in a
step), at two kinds of row counts:

- prefill: the prefill token budget, then halves of it down to :data:`MIN_ROWS`. A
  product of ``m >= MIN_ROWS`` rows runs through the algorithm kept at the largest tuned
  row count ``<= m`` (:meth:`GemmTable.lookup`), if cuBLASLt accepts it for ``m`` rows.
- decode: the batch sizes of the decode CUDA graphs above :data:`SKINNY_ROWS` (fewer
  rows run through the skinny kernel, not a library product), the LM head's shape
  included. The powers of two among them (and the largest) are searched in full
  (:func:`decode_anchors`); each other batch size chooses between ``F.linear`` and the
  algorithms kept at the anchors around it. A product of exactly a tuned batch size runs
  through its algorithm when captured in a decode graph; eager products below
  :data:`MIN_ROWS` keep ``F.linear`` (:meth:`GemmTable.run`).

An algorithm is kept only where it is faster than ``F.linear`` by more than
:data:`MARGIN`. The results are kept on disk per GPU model and library versions
(:class:`~shard.kernels.tuning_cache.TuningCache`), so a restart takes them instead of
searching again.

The choice is held by a :class:`GemmTable`, the runner's
(:attr:`shard.kernels.choices.KernelChoices.gemms`; each tensor-parallel rank tunes its
own shards), and holds until :meth:`GemmTable.clear`. A tuned product differs from
``F.linear``'s by the float32 accumulation order of another kernel (bfloat16 or float16
only).

Source of the method: PyTorch's TunableOp (``torch.cuda.tunable``), which times every
BLAS implementation registered for a GEMM shape and keeps the fastest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from shard.config import ShardConfig
from shard.kernels import cublaslt
from shard.kernels.tuning_cache import TunedProduct, TuningCache

MIN_ROWS = 4096  # prefill sizes from here: the largest tuned row count at or below
SKINNY_ROWS = 16  # up to here the skinny kernel runs the product (shard.layers.linear)
MARGIN = 0.01  # an algorithm is kept only if at least 1% faster than F.linear
FINALISTS = 4  # variants timed again over several weights after the screening
TIMED_WEIGHTS = 4  # weights of a shape a finalist is timed over
QUEUE_CYCLES = 200_000  # GPU clock cycles (~0.1 ms) queued ahead of each timed product


class GemmTable:
    """The cuBLASLt algorithm chosen for each product shape and row count: filled by
    :func:`tune` at warm-up, read by the linear layers (:meth:`run`). Empty: every
    product through ``F.linear``."""

    def __init__(self) -> None:
        # prefill sizes: (n, k, dtype) → [(rows, algorithm)], most rows first
        self._table: dict[tuple[int, int, torch.dtype], list[tuple[int, cublaslt.Algorithm]]] = {}
        # decode sizes: (rows, n, k, dtype) → algorithm
        self._exact: dict[tuple[int, int, int, torch.dtype], cublaslt.Algorithm] = {}
        self._accepted: dict[tuple[int, int, int, torch.dtype, bytes, int | None], bool] = {}

    def record(self, rows: int, n: int, k: int, dtype: torch.dtype,
               algo: cublaslt.Algorithm) -> None:
        """Run ``[rows, k] @ [n, k].T`` products through ``algo`` from now on (see
        :meth:`lookup`)."""
        if rows < MIN_ROWS:
            self._exact[(rows, n, k, dtype)] = algo
            return
        entries = [e for e in self._table.get((n, k, dtype), []) if e[0] != rows]
        self._table[(n, k, dtype)] = sorted([*entries, (rows, algo)], key=lambda e: -e[0])

    def lookup(self, m: int, n: int, k: int, dtype: torch.dtype,
               device: int | None = None) -> cublaslt.Algorithm | None:
        """The tuned algorithm for ``[m, k] @ [n, k].T``: below :data:`MIN_ROWS` the one kept
        for exactly ``m`` rows; from there the one kept at the largest tuned row count
        ``<= m``, if cuBLASLt accepts it for ``m`` rows on CUDA device ``device`` (None: the
        current one); else None (use ``F.linear``)."""
        if m < MIN_ROWS:
            return self._exact.get((m, n, k, dtype))
        entries = self._table.get((n, k, dtype))
        if not entries:
            return None
        algo = next((a for rows, a in entries if rows <= m), None)
        if algo is None:
            return None
        key = (m, n, k, dtype, algo.raw, device)
        accepted = self._accepted.get(key)
        if accepted is None:
            accepted = cublaslt.accepts(m, n, k, dtype, algo, device=device)
            if len(self._accepted) > 4096:
                self._accepted.clear()
            self._accepted[key] = accepted
        return algo if accepted else None

    def clear(self) -> None:
        """Forget every tuned choice (products go back to ``F.linear``)."""
        self._table.clear()
        self._accepted.clear()
        self._exact.clear()

    def tuned(self) -> bool:
        """Whether any product shape runs through a tuned algorithm."""
        return bool(self._table or self._exact)

    def run(self, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ weight.T`` through the tuned algorithm for its shape, or None where there is
        none (2-D contiguous CUDA ``x`` only). Below :data:`MIN_ROWS` only while a CUDA graph
        is being captured (the decode graphs): an eager product that small takes about as
        long to launch from Python as to run, and ``F.linear`` launches faster. Products with
        a ``bias`` are left to ``F.linear`` (its kernel adds the bias in its epilogue; the
        tuning timed products without one)."""
        if bias is not None or x.dim() != 2 or not x.is_contiguous() or not weight.is_contiguous():
            return None
        if x.shape[0] < MIN_ROWS and not torch.cuda.is_current_stream_capturing():
            return None
        algo = self.lookup(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device.index)
        if algo is None:
            return None
        return cublaslt.matmul(x, weight, algo)


def row_counts(max_rows: int) -> list[int]:
    """The row counts tuned for a prefill budget of ``max_rows`` tokens: ``max_rows``,
    then halves down to :data:`MIN_ROWS` (none below it)."""
    counts = []
    rows = max_rows
    while rows >= MIN_ROWS:
        counts.append(rows)
        rows //= 2
    return counts


def time_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int) -> float:
    """Fastest of ``reps`` timings (CUDA events) of ``fn`` over ``weights``, µs per product.

    Each timing starts behind a spin of the GPU (:data:`QUEUE_CYCLES` per product) long
    enough for the host to queue every launch: a decode-sized product takes less time on
    the GPU than its launch from Python (more through ctypes than through ``F.linear``),
    which would otherwise be timed instead of the kernel."""
    fn(weights[0])
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_CYCLES * len(weights))
        start.record()
        for w in weights:
            fn(w)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(weights))
    return best


def decode_plan(rows: Sequence[int],
                elsewhere: Container[int] = ()) -> tuple[list[int], list[int]]:
    """One weight shape's decode row counts: those searched in full (:func:`decode_anchors`
    of ``rows``) and the others above :data:`SKINNY_ROWS` (each choosing among the
    winners of the nearest searched ones), both without the row counts in ``elsewhere``
    (served by another kernel, e.g. the fused gate/up + SwiGLU kernel: never a product)."""
    anchors = decode_anchors(rows)
    others = sorted({r for r in rows if r > SKINNY_ROWS} - set(anchors))
    return [r for r in anchors if r not in elsewhere], [r for r in others if r not in elsewhere]


def served_elsewhere(weights: Sequence[torch.Tensor],
                     elsewhere: Mapping[int, range] | None) -> set[int]:
    """The row counts another kernel serves for every one of ``weights`` (one shape's;
    ``elsewhere``: a weight's ``data_ptr()`` → its row counts served elsewhere). A shape
    shared with a weight that is not served elsewhere, e.g. a small model's LM head of
    gate/up's shape, is tuned at every row count."""
    served = [set((elsewhere or {}).get(w.data_ptr(), ())) for w in weights]
    return set.intersection(*served) if served else set()


def decode_anchors(rows: Sequence[int]) -> list[int]:
    """The decode row counts among ``rows`` searched in full: the powers of two above
    :data:`SKINNY_ROWS`, and the largest (the others choose among their winners)."""
    above = sorted({r for r in rows if r > SKINNY_ROWS})
    return sorted({r for r in above if r & (r - 1) == 0} | set(above[-1:]))


def _through(x: torch.Tensor, out: torch.Tensor,
             algo: cublaslt.Algorithm) -> Callable[[torch.Tensor], object]:
    return lambda w: cublaslt.matmul(x, w, algo, out)


def _keep_fastest(x: torch.Tensor, out: torch.Tensor, weights: list[torch.Tensor],
                  algos: Sequence[cublaslt.Algorithm], default_us: float,
                  table: GemmTable | None) -> tuple[float, cublaslt.Algorithm | None]:
    """Time each of ``algos`` for ``x @ w.T`` over ``weights``; record the fastest for
    this shape and row count in ``table`` (when given) if it beats ``default_us`` by
    :data:`MARGIN`. Returns its µs per product and it, or None where it was not kept."""
    best_us, best = float("inf"), None
    for algo in algos:
        try:
            us = time_us(_through(x, out, algo), weights, reps=3)
        except cublaslt.CublasLtError:
            continue
        if us < best_us:
            best_us, best = us, algo
    if best is None or best_us >= default_us * (1 - MARGIN):
        return best_us, None
    if table is not None:
        n, k = weights[0].shape
        table.record(x.shape[0], n, k, x.dtype, best)
    return best_us, best


def _inputs(rows: int, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weights[0].shape
    x = torch.randn(rows, k, dtype=weights[0].dtype, device=weights[0].device)
    return x, torch.empty(rows, n, dtype=x.dtype, device=x.device)


def tune_shape(rows: int, weights: list[torch.Tensor],
               table: GemmTable | None = None) -> TunedProduct:
    """Time ``F.linear`` and the cuBLASLt variants for ``[rows, k] @ w.T`` over
    ``weights`` (same shape ``[n, k]``, dtype and device) and record the fastest
    variant in ``table`` (when given) if it beats ``F.linear`` by :data:`MARGIN`. At
    decode sizes (fewer than :data:`MIN_ROWS` rows) each variant is screened over
    several weights, so that a weight small enough for the L2 cache is still read from
    HBM, as in a step.

    Raises:
        cublaslt.CublasLtError: if cuBLASLt's heuristic fails for this shape.
    """
    n, k = weights[0].shape
    dtype, device = weights[0].dtype, weights[0].device
    timed = weights[:TIMED_WEIGHTS]
    screened_over = timed[:1] if rows >= MIN_ROWS else timed
    x, out = _inputs(rows, weights)
    default_us = time_us(lambda w: torch.matmul(x, w.t(), out=out), timed, reps=3)
    index = device.index  # None: the current device (cuBLASLt's handle resolves it)

    def screen(algos: list[cublaslt.Algorithm]) -> list[tuple[float, cublaslt.Algorithm]]:
        timings = []
        for algo in algos:
            try:
                timings.append((time_us(_through(x, out, algo), screened_over, reps=1), algo))
            except cublaslt.CublasLtError:
                continue
        return sorted(timings, key=lambda t: t[0])

    # two stages: every tile with each candidate's own cluster shape, then the cluster
    # shapes of the fastest tiles (a seventh of screening every tile with every shape)
    tiles = screen(cublaslt.variants(rows, n, k, dtype, device=index, clusters=()))
    shaped = [v for _, a in tiles[:2 * FINALISTS]
              for v in cublaslt.cluster_variants(rows, n, k, dtype, a, index)[1:]]
    screened = sorted(tiles + screen(shaped), key=lambda t: t[0])
    best_us, keep = _keep_fastest(x, out, timed, [a for _, a in screened[:FINALISTS]],
                                  default_us, table)
    return TunedProduct(rows, n, k, default_us, best_us, keep, len(screened))


def choose_shape(rows: int, weights: list[torch.Tensor], algos: Sequence[cublaslt.Algorithm],
                 table: GemmTable | None = None) -> TunedProduct:
    """Time ``F.linear`` and each of ``algos`` (tuned at other row counts; those cuBLASLt
    rejects for ``rows`` are skipped) for ``[rows, k] @ w.T`` over ``weights``, and
    record the fastest in ``table`` (when given) if it beats ``F.linear`` by
    :data:`MARGIN`."""
    n, k = weights[0].shape
    timed = weights[:TIMED_WEIGHTS]
    x, out = _inputs(rows, weights)
    default_us = time_us(lambda w: torch.matmul(x, w.t(), out=out), timed, reps=3)
    usable = [a for a in algos
              if cublaslt.accepts(rows, n, k, x.dtype, a, device=x.device.index)]
    best_us, keep = _keep_fastest(x, out, timed, usable, default_us, table)
    return TunedProduct(rows, n, k, default_us, best_us, keep, len(usable))


def tunes(config: ShardConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether warm-up tunes the products: ``--gemm-tuning auto`` on CUDA with bfloat16
    or float16 weights."""
    return (config.gemm_tuning == "auto" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def _runs(rows: int, weights: list[torch.Tensor], algorithm: cublaslt.Algorithm) -> bool:
    """Whether cuBLASLt accepts ``algorithm`` for ``rows`` x ``weights[0]`` and runs it
    once, eagerly: its first launch (the handle, the workspace, the plan) then happens
    here, not inside a CUDA graph's capture."""
    n, k = weights[0].shape
    if not cublaslt.accepts(rows, n, k, weights[0].dtype, algorithm,
                            device=weights[0].device.index):
        return False
    x, out = _inputs(rows, weights)
    try:
        cublaslt.matmul(x, weights[0], algorithm, out)
    except cublaslt.CublasLtError:
        return False
    return True


def _tuned(cache: TuningCache | None, rows: int, weights: list[torch.Tensor],
           search: Callable[[], TunedProduct], kind: str, table: GemmTable) -> TunedProduct:
    """The result for ``rows`` x ``weights``' shape: from ``cache`` if recorded there and
    its algorithm still runs (:func:`_runs`; then recorded in ``table``), else
    ``search()``'s (a ``kind`` search), recorded into ``cache`` unless no variant could be
    timed."""
    n, k = weights[0].shape
    dtype = weights[0].dtype
    hit = cache.get(rows, n, k, dtype) if cache is not None else None
    if hit is not None and (hit.algorithm is None or _runs(rows, weights, hit.algorithm)):
        if hit.algorithm is not None:
            table.record(rows, n, k, dtype, hit.algorithm)
        return hit
    result = search()
    if cache is not None and result.screened and result.best_us != float("inf"):
        cache.put(result, dtype, kind)
    return result


def _by_shape(weights: Iterable[torch.Tensor]) -> dict[tuple[int, int, torch.dtype],
                                                         list[torch.Tensor]]:
    by_shape: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for w in weights:
        if w.dim() == 2 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) \
                and w.is_contiguous():
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    return by_shape


def tune(table: GemmTable, weights: Iterable[torch.Tensor], max_rows: int, log: Any = None,
         decode_rows: Sequence[int] = (), decode_weights: Iterable[torch.Tensor] = (),
         cache: TuningCache | None = None,
         decode_elsewhere: Mapping[int, range] | None = None) -> list[TunedProduct]:
    """Tune, into ``table``, every distinct weight shape among ``weights`` (2-D
    contiguous CUDA bfloat16 or float16 tensors; others are skipped) at
    :func:`row_counts` of ``max_rows``, then
    those shapes and ``decode_weights``' (the LM head's: it only ever sees one row per
    sequence) at the ``decode_rows`` above :data:`SKINNY_ROWS` (the decode CUDA graphs'
    batch sizes): in full at :func:`decode_anchors`, each other row count among the
    algorithms kept at the anchors on either side of it (:func:`decode_plan`), except
    the row counts another kernel serves for every weight of the shape
    (``decode_elsewhere``: a weight's ``data_ptr()`` → those row counts). Results
    recorded in ``cache`` are taken from it (``cached``) and new ones recorded there and
    saved. Log each searched result, a summary and the time taken when ``log`` (a loguru
    logger) is given.

    Returns:
        what was measured or taken from ``cache``, one entry per shape and row count.
    """
    by_shape = _by_shape(weights)
    decode_shapes = {key: list(shape_weights) for key, shape_weights in by_shape.items()}
    for key, shape_weights in _by_shape(decode_weights).items():
        decode_shapes.setdefault(key, []).extend(shape_weights)
    started = time.perf_counter()
    results: list[TunedProduct] = []
    if not decode_shapes:
        return results
    try:
        cublaslt.library()
    except (OSError, AttributeError) as e:  # no libcublasLt, or one without these calls
        if log is not None:
            log.warning("products left to cuBLAS: cuBLASLt not usable here ({})", e)
        return results

    def attempt(search: Callable[[], TunedProduct], rows: int, weights: list[torch.Tensor],
                kind: str) -> TunedProduct | None:
        try:
            result = _tuned(cache, rows, weights, search, kind, table)
        except cublaslt.CublasLtError as e:
            if log is not None:
                log.warning("cuBLASLt tuning of {} rows x {} skipped: {}", rows,
                            tuple(weights[0].shape), e)
            return None
        results.append(result)
        if log is not None and kind == "full" and result.screened:
            log.info("product {}", result.describe())
        return result

    device = next(iter(decode_shapes.values()))[0].device
    with torch.cuda.device(device):  # the handle, workspace and timings on the weights' GPU
        for rows in row_counts(max_rows):
            for shape_weights in by_shape.values():
                attempt(partial(tune_shape, rows, shape_weights, table), rows, shape_weights,
                        "full")
        for shape_weights in decode_shapes.values():
            anchors, others = decode_plan(decode_rows,
                                          served_elsewhere(shape_weights, decode_elsewhere))
            kept: dict[int, cublaslt.Algorithm] = {}
            for rows in anchors:
                result = attempt(partial(tune_shape, rows, shape_weights, table), rows,
                                 shape_weights, "full")
                if result is not None and result.algorithm is not None:
                    kept[rows] = result.algorithm
            for rows in others:  # the winners of the nearest anchors on either side
                around = [max((r for r in anchors if r < rows), default=0),
                          min((r for r in anchors if r > rows), default=0)]
                choices = [kept[r] for r in around if r in kept]
                if choices:
                    attempt(partial(choose_shape, rows, shape_weights, choices, table), rows,
                            shape_weights, "choice")
        torch.cuda.empty_cache()
    if cache is not None:
        cache.save()
    if log is not None:
        log.info("tuned {} product shapes and row counts in {:.1f} s ({} through cuBLASLt, "
                 "{} of them decode batch sizes; {} from {})", len(results),
                 time.perf_counter() - started, sum(r.algorithm is not None for r in results),
                 sum(r.algorithm is not None and r.rows < MIN_ROWS for r in results),
                 sum(r.cached for r in results),
                 cache.path if cache is not None else "no cache")
    return results
