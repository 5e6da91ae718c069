"""SwiGLU's ``silu(gate) * up`` as one Triton kernel (CUDA; the interpreter in tests).

Compiled by Inductor with symbolic shapes, the same op reads the two halves of each row
at an offset it cannot prove aligned, and ran at a third of the copy bandwidth on an H200
(34 ms of a 16384-token prefill of an 8B-shaped model, 1.1 ms per layer); this kernel
reads the halves with vector loads.

Before an fp8 product (``down_proj`` with fp8 weights), :func:`silu_and_mul_fp8` writes
the activated row quantized per token (float8 e4m3 and a float32 scale;
:mod:`shard.kernels.fp8_rows`): one program holds the whole row, whose amax sets the
scale, so the row is read once and written once, in a quarter of the bytes of a
bfloat16 gate/up row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.fp8_rows import quantize_row, round_to
from shard.kernels.pdl import launch_options, pdl_start

# longer rows (intermediate features per rank) are left to silu_and_mul + quantize_rows:
# the row is held whole in registers (every current model's are shorter)
MAX_FP8_D = 32768


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # rounded as the eager ops round: silu(gate) to the dtype, then the product
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``[num_tokens, 2 * d] = [gate | up] → silu(gate) * up [num_tokens, d]``, x's
    dtype (:func:`shard.layers.fused.silu_and_mul` is the reference).

    Args:
        x: [num_tokens, 2 * d] (or any leading dims), last dim contiguous.
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).
    """
    d = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(-1) == 1, "the last dim must be contiguous"
    out = torch.empty(rows.shape[0], d, device=x.device, dtype=x.dtype)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=block,
            **launch_options(x.device, pdl),
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, d,
                             BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # silu(gate) rounded to the dtype, then the product, as the eager ops round them;
    # then quantize_rows
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    q, scale = quantize_row(round_to(act * up, dtype))
    tl.store(q_ptr + t * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + t, scale)


def silu_and_mul_fp8(x: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor,
                                                                      torch.Tensor] | None:
    """:func:`silu_and_mul` with its rows written quantized per token for an fp8
    product: float8 e4m3 with a float32 scale per row, ``amax / 448`` (FP8 formats:
    Micikevicius et al. 2022, arXiv:2209.05433). The reference:
    :func:`shard.layers.fused.silu_and_mul`, then
    :func:`shard.quantization.fp8.quantize_rows`; the e4m3 values are the reference's
    wherever ``silu(gate) * up`` rounds the same way to the dtype (``exp`` may differ in
    its last float32 bit, moving such a rounding by an ulp, then a value by one e4m3
    step).

    Args:
        x: [num_tokens, 2 * d] = [gate | up], fp16/bf16/fp32, last dim contiguous,
            ``d <=`` :data:`MAX_FP8_D` (CUDA with fp8 conversions, compute capability
            8.9+; Triton's interpreter).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        (q [num_tokens, d] float8_e4m3fn, scale [num_tokens] float32), ``silu(gate) * up
        ≈ q * scale[:, None]``; None when the inputs are not as above (the caller runs
        the reference instead).
    """
    d = x.shape[-1] // 2
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[-1] % 2 or d > MAX_FP8_D:
        return None
    num_tokens = x.shape[0]
    q = torch.empty(num_tokens, d, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(num_tokens, device=x.device, dtype=torch.float32)
    if num_tokens:
        block = triton.next_power_of_2(d)
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            x, q, scale, x.stride(0), q.stride(0), d, BLOCK=block,
            num_warps=max(1, min(16, block // 512)), **launch_options(x.device, pdl),
        )
    return q, scale
