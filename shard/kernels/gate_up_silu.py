"""SwiGLU's ``silu(x @ W_gate.T) * (x @ W_up.T)`` as one Triton GEMM with the activation
in its epilogue (CUDA; the interpreter in tests), for decode batches of 1 to 128 rows.

The MLP's gate/up projection writes ``[rows, 2 * intermediate]`` and a second kernel
reads it back to write ``[rows, intermediate]``
(:mod:`shard.kernels.silu_mul`). Here each program owns ``BLOCK_M`` rows and
``BLOCK_N`` intermediate features: it streams the matching rows of both halves of the
fused weight (``[gate | up]``, as :class:`~shard.layers.linear.MergedColumnParallelLinear`
holds them on every rank) over the whole of K into two float32 accumulators, then writes
the activated product only: no intermediate tensor, no second kernel. Up to 16 rows it
is the skinny kernel's scheme (:mod:`shard.kernels.skinny_gemm`): one 16-row tile,
narrow column blocks over the whole of K.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start

# Row counts this kernel takes by default: up to the most rows where it measured faster
# than the unfused path at the 8B-shaped model's gate/up: 0.97 of the skinny kernel +
# silu·mul at 1 and 16 rows (H100; benchmarks/results/gpu-serving-h200.md, 2026-12-06),
# 0.94-0.99 of cuBLAS + silu·mul at 32-128 rows, 1.19-1.21 at 256-512 (H200;
# benchmarks/results/kernels-h200.md); larger batches and prefills stay on cuBLAS.
MIN_ROWS = 1
MAX_ROWS = 128
# dtypes it takes (float32 stays on cuBLAS, exact)
DTYPES = (torch.float16, torch.bfloat16)


class GateUpConfig(NamedTuple):
    """Tiles and pipeline depth (``benchmarks/kernels/kernel_sweep.py --gate-up`` sweeps them)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def default_config(rows: int) -> GateUpConfig:
    """The configuration for ``rows`` rows: one 16-row tile up to 16 rows (the sweep's
    best at 1 and 16 rows), the H200 sweep's best at 32 and 64 rows up to 64 rows, its
    best at 128 rows above."""
    if rows <= 16:
        return GateUpConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)
    if rows <= 64:
        return GateUpConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return GateUpConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # the programs of one column block run next to each other: its weight rows are read
    # from HBM once and from L2 by the other row blocks
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    gate_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    up_ptrs = gate_ptrs + N * stride_wn  # the up half: rows N.. of the fused weight
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, tl.trans(gate_w), acc_gate)
        acc_up = tl.dot(x, tl.trans(up_w), acc_up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    # rounded as the unfused ops round: each projection to the dtype, silu(gate) to the
    # dtype, then the product
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, (act * up).to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def gate_up_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GateUpConfig | None = None,
    min_rows: int = MIN_ROWS,
    max_rows: int = MAX_ROWS,
    *,
    pdl: bool = False,
) -> torch.Tensor | None:
    """``silu(gate) * up`` with ``[gate | up] = x @ weight.T`` (the reference:
    ``F.linear`` then :func:`shard.layers.fused.silu_and_mul`), float32 accumulation.

    Args:
        x: [num_tokens, in_features], fp16/bf16, last dim contiguous, ``min_rows <=
            num_tokens <= max_rows``.
        weight: [2 * intermediate, in_features] (gate rows, then up rows), x's dtype,
            last dim contiguous.
        config: tiles and pipeline depth (default :func:`default_config`).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        [num_tokens, intermediate] in x's dtype; None when the inputs are not as above, or
        when autograd would record the product (the caller runs the reference instead).
    """
    if not (x.dim() == 2 and weight.dim() == 2 and min_rows <= x.shape[0] <= max_rows
            and x.dtype in DTYPES and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == x.shape[1]
            and weight.shape[0] % 2 == 0):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    m, k = x.shape
    n = weight.shape[0] // 2
    cfg = config or default_config(m)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gate_up_silu_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device, pdl),
    )
    return out
