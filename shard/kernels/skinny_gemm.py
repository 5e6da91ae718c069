"""``x @ weight.T (+ bias)`` for a few rows of ``x`` (decode at small batch) as one Triton
kernel (CUDA; the interpreter in tests).

At one to sixteen tokens a projection reads its whole weight for a handful of products:
its time is the weight's bytes over the memory bandwidth plus the kernel's ramp and
tail. cuBLAS picks tiles made for larger products there (and split-K with a second
reduction kernel); on an H200 its one-row products of an 8B-shaped model stream the
weights at 2.6–4.1 TB/s against a copy bandwidth of ~4.3 TB/s
(``benchmarks/results/kernels-h200.md``). Here each program owns ``BLOCK_N`` output
features and streams their weight rows over the whole of K in ``BLOCK_K`` slices,
multi-buffered (``num_stages``), with the rows of ``x`` padded to one 16-row
tensor-core tile (``tl.dot``, float32 accumulation): no split-K, no second kernel.

Folding the op before a projection into its programs measured slower on an H200, since
each of the N / BLOCK_N programs redoes that op over all 16 padded rows: SwiGLU's
activation before ``down_proj`` took the step's skinny kernels from 3.7 to 8.6 ms at
one token, and RMSNorm before ``qkv_proj`` and ``gate_up_proj`` (a serial pass over the
rows for their mean square before the weights stream) was slower still. Those ops stay
separate kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start

# the rows of x padded to one tensor-core tile: the most rows this kernel takes
MAX_ROWS = 16


class SkinnyConfig(NamedTuple):
    """Tiles and pipeline depth of the kernel (``benchmarks/kernels/kernel_sweep.py --skinny``
    sweeps them)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def default_config(n: int, k: int) -> SkinnyConfig:
    """The configuration for an ``[n, k]`` weight, by ``n``: the H200 sweep's best at one
    token for the 8B-shaped model's o and down (n = 4096) and gate_up (28672), within 4%
    of it for qkv (6144) and 2% for the LM head (49152)
    (``benchmarks/results/kernels-h200.md``); tiles capped to the problem for small ones.
    Cached: eager launches (short prefills, decode without graphs) ask for it per product."""
    if n <= 4096:
        cfg = SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
    elif n <= 8192:
        cfg = SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)
    else:
        cfg = SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    return cfg._replace(block_n=min(cfg.block_n, max(16, triton.next_power_of_2(n))),
                        block_k=min(cfg.block_k, max(16, triton.next_power_of_2(k))))


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    x_scale_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rows < M
    n_mask = rn < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + rk[None, :]
    # 64-bit row offsets: a vocabulary-sized weight can pass 2**31 elements (256k x 8192)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SCALED:  # e4m3 values are exact in float16 (a tensor-core dot on every GPU)
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALED:
        x_scale = tl.load(x_scale_ptr + rows, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` (``torch.nn.functional.linear``, the reference) for up to
    :data:`MAX_ROWS` rows, float32 accumulation.

    Args:
        x: [num_tokens, in_features], fp16/bf16, last dim contiguous, 1 <= num_tokens <=
            :data:`MAX_ROWS`.
        weight: [out_features, in_features], x's dtype, last dim contiguous.
        bias: None or [out_features], x's dtype, contiguous.
        config: tiles and pipeline depth (default :func:`default_config`).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        [num_tokens, out_features] in x's dtype; None when the inputs are not as above, or
        when autograd would record the product (the caller runs the reference instead).
    """
    if not (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == x.shape[1]
            and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype
                                  and bias.is_contiguous()))):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    m = x.shape[0]
    n, k = weight.shape
    cfg = config or default_config(n, k)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, weight, weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SCALED=False,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device, pdl),
    )
    return out


def skinny_fp8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: SkinnyConfig | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor | None:
    """The fp8 product ``(x_q · x_scale) (weight · weight_scale)^T`` for up to
    :data:`MAX_ROWS` rows: what :func:`shard.quantization.fp8.fp8_linear` computes with
    ``torch._scaled_mm`` (the reference), through the skinny kernel. The e4m3 operands
    are widened to float16 in registers (exact) for a float16 tensor-core dot with
    float32 accumulation, and both scales applied to the accumulator. At a handful of
    rows the product is a read of the weight (one byte per value): this kernel spreads it
    over ``N / BLOCK_N`` programs (128 for a 4096-row weight), without split-K. Warm-up
    measures it against ``torch._scaled_mm`` and keeps the faster per shape and row count
    (:mod:`shard.kernels.fp8_tuning`).

    Args:
        x_q: [num_tokens, in_features] float8_e4m3fn, last dim contiguous, 1 <= num_tokens
            <= :data:`MAX_ROWS`.
        x_scale: [num_tokens] float32, contiguous, one scale per token.
        weight: [out_features, in_features] float8_e4m3fn, last dim contiguous.
        weight_scale: [out_features] float32, contiguous, one scale per output channel.
        out_dtype: the output dtype (float16, bfloat16 or float32).
        config: tiles and pipeline depth (default :func:`default_config`).
        pdl: launch with programmatic dependent launch where it runs.

    Returns:
        [num_tokens, out_features] in ``out_dtype``; None when the inputs are not as
        above (the caller runs the reference).
    """
    fp8 = torch.float8_e4m3fn
    if not (x_q.dim() == 2 and weight.dim() == 2 and 1 <= x_q.shape[0] <= MAX_ROWS
            and x_q.dtype == fp8 and weight.dtype == fp8 and weight.shape[1] == x_q.shape[1]
            and x_q.stride(-1) == 1 and weight.stride(-1) == 1
            and x_scale.shape == x_q.shape[:1] and x_scale.dtype == torch.float32
            and x_scale.is_contiguous() and weight_scale.shape == weight.shape[:1]
            and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            and out_dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    m = x_q.shape[0]
    n, k = weight.shape
    cfg = config or default_config(n, k)
    out = torch.empty(m, n, device=x_q.device, dtype=out_dtype)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x_q, weight, weight, x_scale, weight_scale, out, m, n, k,
        x_q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=False, SCALED=True,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x_q.device, pdl),
    )
    return out
