"""SwiGLU's ``silu(x @ W_gate.T) * (x @ W_up.T)`` as one Triton GEMM with the activation
in its epilogue (CUDA; the interpreter in tests), for decode batches of 17 to 128 rows.

The MLP's gate/up projection writes ``[rows, 2 * intermediate]`` and a second kernel
reads it back to write ``[rows, intermediate]``
(:mod:`shard.layers.silu_mul_kernel`). Here each program owns ``BLOCK_M`` rows and
``BLOCK_N`` intermediate features: it streams the matching rows of both halves of the
fused weight (``[gate | up]``, as :class:`~shard.layers.linear.MergedColumnParallelLinear`
holds them on every rank) over the whole of K into two float32 accumulators, then writes
the activated product only: no intermediate tensor, no second kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shard.pdl import launch_options, pdl_start

# Row counts this kernel takes by default: from one row past the skinny kernel's bound to
# the most rows where it measured faster than cuBLAS + silu·mul on an H200 at the
# 8B-shaped model's gate/up (0.94-0.99 of its time at 32-128 rows, 1.19-1.21 at 256-512:
# benchmarks/results/kernels-h200.md); larger batches and prefills stay on cuBLAS.
MIN_ROWS = 17
MAX_ROWS = 128


class GateUpConfig(NamedTuple):
    """Tiles and pipeline depth (``benchmarks/kernel_sweep.py --gate-up`` sweeps them)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def default_config(rows: int) -> GateUpConfig:
    """The configuration for ``rows`` rows: the H200 sweep's best at 32 and 64 rows up to
    64 rows, its best at 128 rows above."""
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
) -> torch.Tensor | None:
    """``silu(gate) * up`` with ``[gate | up] = x @ weight.T`` (the reference:
    ``F.linear`` then :func:`shard.layers.fused.silu_and_mul`), float32 accumulation.

    Args:
        x: [num_tokens, in_features], fp16/bf16, last dim contiguous, ``min_rows <=
            num_tokens <= max_rows``.
        weight: [2 * intermediate, in_features] (gate rows, then up rows), x's dtype,
            last dim contiguous.
        config: tiles and pipeline depth (default :func:`default_config`).

    Returns:
        [num_tokens, intermediate] in x's dtype; None when the inputs are not as above, or
        when autograd would record the product (the caller runs the reference instead).
    """
    if not (x.dim() == 2 and weight.dim() == 2 and min_rows <= x.shape[0] <= max_rows
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
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
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )
    return out


class TmaConfig(NamedTuple):
    """Tiles, pipeline and tile order of :func:`gate_up_silu_tma` (``benchmarks/
    kernel_sweep.py --gate-up-tma`` sweeps them).

    ``group`` consecutive tiles share their weight rows (``group_along_n``: the programs
    of a group take ``group`` column blocks across every row block, so a column block's
    weight rows are read from HBM once per pass over the rows and the activations
    ``N / (group * block_n)`` times) or their activation rows (the other way round).
    ``persistent``: one program per SM loops over the tiles. ``warp_specialize``: Triton's
    warp specialization of the loop over tiles (loads and products in separate warps).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 8
    group_along_n: bool = True
    persistent: bool = True
    warp_specialize: bool = False


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP: tl.constexpr, GROUP_ALONG_N: tl.constexpr):
    """Row and column block of tile ``tile`` in grouped order (see :class:`TmaConfig`)."""
    if GROUP_ALONG_N:
        per_group = GROUP * num_m
        first_n = (tile // per_group) * GROUP
        size = min(num_n - first_n, GROUP)
        pid_n = first_n + (tile % per_group) % size
        pid_m = (tile % per_group) // size
    else:
        per_group = GROUP * num_n
        first_m = (tile // per_group) * GROUP
        size = min(num_m - first_m, GROUP)
        pid_m = first_m + (tile % per_group) % size
        pid_n = (tile % per_group) // size
    return pid_m, pid_n


@triton.jit
def _gate_up_silu_tma_kernel(
    x_desc,
    w_desc,
    out_desc,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ALONG_N: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    dtype = out_desc.dtype
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP, GROUP_ALONG_N)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # rows past M and columns past K come in as zeros (the descriptors' bounds);
            # a last column block past N reads up rows into its gate tile, and the store
            # clips those columns
            x = x_desc.load([off_m, k0])
            gate_w = w_desc.load([off_n, k0])
            up_w = w_desc.load([N + off_n, k0])
            acc_gate = tl.dot(x, gate_w.T, acc_gate)
            acc_up = tl.dot(x, up_w.T, acc_up)
        # rounded as the unfused ops round (see _gate_up_silu_kernel)
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out_desc.store([off_m, off_n], (act * up).to(dtype))


def gate_up_silu_tma(x: torch.Tensor, weight: torch.Tensor, config: TmaConfig) -> torch.Tensor:
    """:func:`gate_up_silu` through tensor-memory-accelerator (TMA) descriptors, for prefill
    row counts: the same product, activation and rounding; ``weight`` holds the gate
    rows then the up rows.

    Args:
        x: [num_tokens, in_features], fp16/bf16, contiguous rows (16-byte aligned strides).
        weight: [2 * intermediate, in_features], x's dtype, contiguous.
        config: tiles, pipeline and tile order.

    Returns:
        [num_tokens, intermediate] in x's dtype.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0] // 2
    cfg = config
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = tiles
    if cfg.persistent and x.is_cuda:
        programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    _gate_up_silu_tma_kernel[(programs,)](
        x_desc, w_desc, out_desc, m, n, k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=cfg.group,
        GROUP_ALONG_N=cfg.group_along_n, NUM_PROGRAMS=programs,
        WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )
    return out
