"""Which kernel runs each fp8 product of a few rows, measured at warm-up.

An fp8 product (:func:`shard.quantization.fp8.fp8_linear`) of up to
:data:`~shard.kernels.skinny_gemm.MAX_ROWS` rows can run through ``torch._scaled_mm``
(the row-wise scaled product of cuBLASLt / CUTLASS) or through our skinny kernel
(:func:`shard.kernels.skinny_gemm.skinny_fp8_linear`), which streams the weight at one
byte per value over every SM where the library's tiles leave most of them idle at a
handful of rows. Both sum the exact products of e4m3 values (the kernel in float32;
Hopper's fp8 tensor cores keep fewer bits within each run of the sum), so they agree to
about the output's bfloat16 rounding. At warm-up :func:`tune` times the two, for each fp8
weight shape of the model and every row count from 1 to ``MAX_ROWS``, over several of the
model's own weights of that shape (read from HBM, as in a step), and keeps
``torch._scaled_mm`` where the kernel measured slower by more than
:data:`~shard.kernels.gemm_tuning.MARGIN`; elsewhere, and where nothing was timed
(``--gemm-tuning off``), the skinny kernel runs. Larger products always run through
``torch._scaled_mm``.

Source of the method: PyTorch's TunableOp (``torch.cuda.tunable``), as for the unquantized
products (:mod:`shard.kernels.gemm_tuning`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shard.kernels.gemm_tuning import MARGIN, TIMED_WEIGHTS, time_us

# The signature of shard.kernels.skinny_gemm.skinny_fp8_linear:
# (x_q, x_scale, weight, weight_scale, out_dtype) -> out or None
SkinnyFp8 = Callable[..., torch.Tensor | None]


class Fp8Table:
    """The fp8 products of a few rows measured faster through ``torch._scaled_mm`` than
    through the skinny kernel: filled by :func:`tune`, read by
    :meth:`shard.kernels.choices.KernelChoices.fp8_product`. Empty: the skinny kernel
    for every product it takes."""

    def __init__(self) -> None:
        self._library: set[tuple[int, int, int]] = set()  # (rows, n, k)

    def record(self, rows: int, n: int, k: int, skinny: bool) -> None:
        """Run ``[rows, k] @ [n, k].T`` fp8 products through the skinny kernel (``skinny``)
        or ``torch._scaled_mm`` from now on."""
        if skinny:
            self._library.discard((rows, n, k))
        else:
            self._library.add((rows, n, k))

    def skinny(self, rows: int, n: int, k: int) -> bool:
        """Whether an fp8 product of this shape and row count runs through the skinny
        kernel (it was not measured slower than ``torch._scaled_mm``)."""
        return (rows, n, k) not in self._library

    def clear(self) -> None:
        """Forget every measurement: the skinny kernel wherever it takes the product."""
        self._library.clear()


@dataclass(frozen=True)
class Fp8Timing:
    """One fp8 product shape at one row count, as :func:`tune` timed it.

    Attributes:
        rows, n, k: ``[rows, k] @ [n, k].T``.
        skinny_us: µs per product through the skinny kernel.
        library_us: µs per product through ``torch._scaled_mm``.
    """

    rows: int
    n: int
    k: int
    skinny_us: float
    library_us: float

    @property
    def skinny(self) -> bool:
        """Whether the skinny kernel is kept: not slower than the library by
        :data:`~shard.kernels.gemm_tuning.MARGIN`."""
        return self.skinny_us <= self.library_us * (1 + MARGIN)


def _by_shape(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]
              ) -> dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]]:
    by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for weight, scale in layers:
        by_shape.setdefault(tuple(weight.shape), []).append((weight, scale))  # type: ignore[arg-type]
    return by_shape


def time_shape(rows: int, layers: list[tuple[torch.Tensor, torch.Tensor]],
               skinny: SkinnyFp8, out_dtype: torch.dtype, reps: int = 3) -> Fp8Timing:
    """Time ``[rows, k] @ w.T`` fp8 products over ``layers`` (fp8 weights of one shape
    ``[n, k]`` with their scales [n] float32, on one CUDA device) through ``skinny`` and
    through ``torch._scaled_mm`` (row-wise scales, ``out_dtype`` output), the fastest of
    ``reps`` timings each.

    Raises:
        RuntimeError: ``skinny`` declined the inputs.
        Exception: whatever compiling or launching either product raised.
    """
    n, k = layers[0][0].shape
    device = layers[0][0].device
    timed = layers[:TIMED_WEIGHTS]
    x_q = torch.randn(rows, k, device=device).to(torch.float8_e4m3fn)
    x_scale = torch.rand(rows, device=device) + 0.5
    scales = {w.data_ptr(): s for w, s in timed}
    weights = [w for w, _ in timed]

    def through_skinny(w: torch.Tensor) -> torch.Tensor:
        out = skinny(x_q, x_scale, w, scales[w.data_ptr()], out_dtype)
        if out is None:
            raise RuntimeError(f"the skinny fp8 kernel declined {rows} x {tuple(w.shape)}")
        return out

    def through_library(w: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(x_q, w.t(), scale_a=x_scale[:, None],
                                scale_b=scales[w.data_ptr()][None, :], out_dtype=out_dtype)

    return Fp8Timing(rows, n, k, time_us(through_skinny, weights, reps=reps),
                     time_us(through_library, weights, reps=reps))


def tune(table: Fp8Table, layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
         skinny: SkinnyFp8, max_rows: int, out_dtype: torch.dtype = torch.bfloat16,
         log: Any = None) -> list[Fp8Timing]:
    """Time, for each distinct shape among ``layers`` (fp8 weights [n, k] float8_e4m3fn
    with their per-channel scales [n] float32, CUDA), the skinny kernel against
    ``torch._scaled_mm`` at 1 to ``max_rows`` rows (:func:`time_shape`), and record in
    ``table`` which one each product of that shape and row count runs through. Logs
    (``log``, a loguru logger) what was kept, with the one-row timings.

    Returns:
        the timings, one per shape and row count.

    Raises:
        Exception: whatever the skinny kernel raised (a compile error on this GPU); the
            table is then left as it was.
    """
    started = time.perf_counter()
    timings = [time_shape(rows, shape_layers, skinny, out_dtype)
               for shape_layers in _by_shape(layers).values()
               for rows in range(1, max_rows + 1)]
    for t in timings:
        table.record(t.rows, t.n, t.k, t.skinny)
    if log is not None and timings:
        one_row = ", ".join(f"{t.n}x{t.k} {t.skinny_us:.1f}/{t.library_us:.1f} µs"
                            for t in timings if t.rows == 1)
        log.info("fp8 products of 1-{} rows: the skinny kernel kept for {} of {} shapes and "
                 "row counts, torch._scaled_mm for the rest; one row, skinny/library: {} "
                 "({:.1f} s)", max_rows, sum(t.skinny for t in timings), len(timings),
                 one_row, time.perf_counter() - started)
    return timings
