"""FP8 numerics: float8 e4m3 quantization by rows and the fp8 linear product.

Format: OCP 8-bit floating point, E4M3 variant (``torch.float8_e4m3fn``: 4 exponent and 3
mantissa bits, no infinities, largest finite value 448; Micikevicius et al. 2022, "FP8
Formats for Deep Learning", arXiv:2209.05433). A tensor is stored as ``q = x / scale``
rounded to e4m3 (round to nearest even, saturated at ±448) and read back as
``q * scale``; with ``scale = amax / 448`` over the values that share it, the largest
of them lands on 448 and the relative rounding error of every normal value is at most
2^-4.

Weights get a scale per output channel (row of ``[out_features, in_features]``), chosen
at load by squared error (:func:`quantize_rows_mse`); activations one per token (row of
``[num_tokens, in_features]``), ``amax / 448``, computed at run time, or handed over
already quantized by the op before the product (:class:`Fp8Activations`, written by our
fused RMSNorm and SwiGLU kernels); the product
``(x_q · s_x) (W_q · s_w)^T = (x_q W_q^T) ⊙ (s_x s_w^T)`` runs through
``torch._scaled_mm`` with both scale vectors ("row-wise" scaling: cuBLASLt / CUTLASS's
fp8 tensor-core path on CUDA compute capability 8.9+, a reference implementation on
CPU, where it runs every shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.layers.fused import cuda_compiled

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# The smallest scale: a row of zeros (or of values this small) quantizes to zeros
# instead of dividing by zero.
MIN_SCALE = 1e-12


@dataclass(frozen=True)
class Fp8Activations:
    """Activations already quantized per token, as :func:`quantize_rows` quantizes them,
    handed to :func:`fp8_linear` in place of ``x`` (by
    :class:`~shard.layers.norm.RMSNorm` and :class:`~shard.layers.activation.SiluAndMul`
    built for an fp8 product).

    Attributes:
        q: [num_tokens, in_features] float8_e4m3fn.
        scale: [num_tokens] float32, ``x ≈ q * scale[:, None]``.
        dtype: the dtype of the activations they stand for (the model's): the product's
            output dtype.
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def is_fp8(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds float8 values (any fp8 dtype)."""
    return tensor.dtype in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    )


@cuda_compiled
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dimension) of ``x`` to e4m3 with its own scale
    ``amax(|row|) / 448``.

    Args:
        x: [..., n], any float dtype.

    Returns:
        (q [..., n] float8_e4m3fn, scale [...] float32), ``x ≈ q * scale[..., None]``.
    """
    h = x.to(torch.float32)
    scale = (h.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (h / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_rows_mse(
    x: torch.Tensor, shrink: float = 0.5, steps: int = 51
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to e4m3 with the scale, among ``f * amax(|row|) / 448``
    for ``steps`` factors ``f`` from 1 down to ``shrink``, that minimises the row's squared
    error (values beyond ``448 * scale`` saturate). For weights, once, at load: on
    SmolLM2-135M it lowers the perplexity cost of fp8 weights by about half against
    ``amax / 448`` alone (benchmarks/results/fp8-quality-cpu.md).

    Source: the grid search of the clipping ratio by squared error of GPTQ's reference
    quantizer (``Quantizer.find_params(mse=True)``; Frantar et al. 2022,
    arXiv:2210.17323), over e4m3 values instead of an integer grid.

    Args:
        x: [rows, n], any float dtype.

    Returns:
        (q [rows, n] float8_e4m3fn, scale [rows] float32), ``x ≈ q * scale[:, None]``.
    """
    h = x.to(torch.float32)
    amax = h.abs().amax(dim=-1)
    best_err = torch.full_like(amax, float("inf"))
    best = torch.empty_like(amax)
    for factor in torch.linspace(1.0, shrink, steps).tolist():
        scale = (amax * (factor / FP8_MAX)).clamp(min=MIN_SCALE)
        q = (h / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        err = (q.to(torch.float32) * scale[:, None] - h).square().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, scale, best)
    return quantize_with_scale.eager(h, best[:, None]), best  # type: ignore[attr-defined]


@cuda_compiled
def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` [..., n] to e4m3 with a given ``scale`` (a float32 scalar, e.g. a
    checkpoint's static ``input_scale``, or one per row, [..., 1]); values beyond
    ``448 * scale`` saturate."""
    h = x.to(torch.float32) / scale
    return h.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale[..., None]`` in ``dtype``: the inverse of :func:`quantize_rows`.

    Args:
        q: [..., n] float8.
        scale: [...] float32 (or a scalar: one scale for all rows).
    """
    scale = scale.to(torch.float32)
    if scale.dim():
        scale = scale[..., None]
    return (q.to(torch.float32) * scale).to(dtype)


def _quantized(
    x: torch.Tensor | Fp8Activations, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Size, torch.dtype]:
    """(q [rows, in_features] float8_e4m3fn, scale [rows] float32, x's shape, x's dtype)
    of :func:`fp8_linear`'s activations."""
    if isinstance(x, Fp8Activations):
        assert input_scale is None, "activations quantized per token for a static scale"
        return x.q, x.scale, x.q.shape, x.dtype
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        x_q, x_scale = quantize_rows(rows)
    else:
        x_q = quantize_with_scale(rows, input_scale)
        x_scale = input_scale.to(torch.float32).expand(rows.shape[0]).contiguous()
    return x_q, x_scale, x.shape, x.dtype


def fp8_linear(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    few_rows: Callable[..., torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` through an fp8 product.

    The activations are quantized per token (dynamically), or with ``input_scale``
    when a checkpoint gives one (static, per tensor), or come quantized per token
    (:class:`Fp8Activations`); the product runs in
    ``torch._scaled_mm`` with the activations' and the weight's scales applied to its
    float32 accumulator. On CUDA the row-wise scaled product writes bfloat16 (the output
    it supports), cast to ``x``'s dtype for a float16/float32 model; on CPU it writes
    ``x``'s dtype.

    Args:
        x: [num_tokens, in_features] (or [..., in_features]), float16/bfloat16/float32;
            or :class:`Fp8Activations` of [num_tokens, in_features] (then no
            ``input_scale``), standing for activations of their ``dtype``.
        weight: [out_features, in_features] float8_e4m3fn, contiguous.
        weight_scale: [out_features] float32, one scale per output channel.
        bias: [out_features] in ``x``'s dtype, added after the product, or None.
        input_scale: float32 scalar, or None (per-token scales computed here).
        few_rows: another kernel for the product, tried first, called as
            ``few_rows(x_q, x_scale, weight, weight_scale, out_dtype)``; None from it
            (inputs it does not take) sends the product to ``torch._scaled_mm``
            (:meth:`shard.kernels.choices.KernelChoices.fp8_product`: our skinny kernel at
            up to 16 rows on CUDA).

    Returns:
        [..., out_features] in ``x``'s dtype.
    """
    x_q, x_scale, shape, dtype = _quantized(x, input_scale)
    out_dtype = dtype if not x_q.is_cuda else torch.bfloat16
    out = few_rows(x_q, x_scale, weight, weight_scale, out_dtype) if few_rows else None
    if out is None:
        out = torch._scaled_mm(
            x_q,
            weight.t(),
            scale_a=x_scale[:, None],
            scale_b=weight_scale[None, :],
            out_dtype=out_dtype,
        )
    if out.dtype != dtype:
        out = out.to(dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])
