"""RMSNorm, with or without the residual add before it, as one Triton kernel (CUDA; the
interpreter in tests).

One program normalises one row held whole in registers: the row is read once and the
sum (when there is a residual) and the normalised row written once. Inductor's compiled
version of the same op (:func:`shard.layers.fused.add_rms_norm`, the reference) ran
2.8 µs per call at one token on an H200, 178 µs of a 4.46 ms batch-1 decode step of an
8B-shaped model (64 calls).

Before an fp8 product, :func:`add_rms_norm_fp8` writes the normalised row quantized per
token instead (float8 e4m3 and a float32 scale; :mod:`shard.kernels.fp8_rows`), from the
same registers: the product reads 1 byte per value, and no second kernel reads the row
back to quantize it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.fp8_rows import quantize_row, round_to
from shard.kernels.pdl import launch_options, pdl_start

# longer rows are left to the compiled op (every current model's are shorter)
MAX_HIDDEN = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    total_ptr,
    stride_x,
    stride_r,
    stride_out,
    stride_total,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the sum rounded to the dtype, as the eager add rounds it
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(total_ptr + row * stride_total + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Hugging Face Llama's order: normalise in float32, cast to the dtype, then weight
    normed = (h * inv_rms).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(dtype), mask=mask)


def _takes(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the kernels take these rows (see :func:`add_rms_norm`)."""
    return not (x.dim() != 2 or x.stride(-1) != 1 or x.shape[-1] > MAX_HIDDEN
                or weight.dtype != x.dtype or not weight.is_contiguous()
                or (residual is not None and (residual.shape != x.shape
                                              or residual.dtype != x.dtype
                                              or residual.stride(-1) != 1)))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """RMSNorm (Zhang & Sennrich 2019) of ``x + residual`` (of ``x`` when ``residual``
    is None) with Hugging Face Llama's numerics; :func:`shard.layers.fused.add_rms_norm`
    and :func:`shard.layers.fused.rms_norm` are the references.

    Args:
        x: [num_tokens, hidden], fp16/bf16/fp32, last dim contiguous, hidden <=
            :data:`MAX_HIDDEN`.
        residual: None, or x's shape and dtype with a contiguous last dim.
        weight: [hidden], x's dtype, contiguous.
        eps: added to the mean square.
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        (normalised row [num_tokens, hidden], the sum [num_tokens, hidden] or None
        without a residual), x's dtype; None when the inputs are not as above (the
        caller runs the reference instead).
    """
    if not _takes(x, residual, weight):
        return None
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        r = residual if residual is not None else x
        t = total if total is not None else out
        _rms_norm_kernel[(num_tokens,)](
            x, r, weight, out, t, x.stride(0), r.stride(0), out.stride(0), t.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=max(1, min(16, block // 512)), **launch_options(x.device, pdl),
        )
    return out, total


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    total_ptr,
    stride_x,
    stride_r,
    stride_q,
    stride_total,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = round_to(h + r.to(tl.float32), dtype)  # the sum as the eager add rounds it
        tl.store(total_ptr + row * stride_total + cols, h.to(dtype), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # the normalised row in the dtype, as add_rms_norm writes it; then quantize_rows
    y = round_to(w * round_to(h * inv_rms, dtype), dtype)
    q, scale = quantize_row(y)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """:func:`add_rms_norm` with its normalised rows written quantized per token for an
    fp8 product: float8 e4m3 with a float32 scale per row, ``amax / 448`` (FP8 formats:
    Micikevicius et al. 2022, arXiv:2209.05433), in the same pass over the row. The
    reference: :func:`add_rms_norm`'s reference, then
    :func:`shard.quantization.fp8.quantize_rows`; the e4m3 values are the reference's
    wherever the normalised row rounds the same way (summation order may move a rounding
    to the dtype by an ulp, then a value by one e4m3 step).

    Args:
        x, residual, weight, eps, pdl: as :func:`add_rms_norm` takes them (fp16/bf16/fp32
            on CUDA with fp8 conversions, compute capability 8.9+; Triton's interpreter).

    Returns:
        (q [num_tokens, hidden] float8_e4m3fn, scale [num_tokens] float32 with ``normed
        ≈ q * scale[:, None]``, the sum [num_tokens, hidden] in x's dtype or None without
        a residual); None when :func:`add_rms_norm` would decline the inputs.
    """
    if not _takes(x, residual, weight):
        return None
    num_tokens, hidden = x.shape
    q = torch.empty(num_tokens, hidden, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(num_tokens, device=x.device, dtype=torch.float32)
    total = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        r = residual if residual is not None else x
        t = total if total is not None else x  # not written without a residual
        _rms_norm_fp8_kernel[(num_tokens,)](
            x, r, weight, q, scale, t, x.stride(0), r.stride(0), q.stride(0), t.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=max(1, min(16, block // 512)), **launch_options(x.device, pdl),
        )
    return q, scale, total
