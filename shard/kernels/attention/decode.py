"""Split-KV paged decode attention ("flash-decoding").

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023 blog post) on top of the
online softmax of FlashAttention-2 (Dao 2023), reading K/V through block tables
(PagedAttention, Kwon et al. 2023).

Each program handles one sequence, one KV head and one split of the context: it loads
the ``num_heads / num_kv_heads`` query heads that share that KV head as the rows of one
matrix, so each KV tile is read from memory once for the whole group. With one split the
program writes the output directly; otherwise it writes a partial output and its
log-sum-exp (base 2) and a second kernel combines the splits.

From an fp8 cache (:mod:`shard.kv_cache`) a tile's keys and values are converted to the
query's dtype in registers and each token's scales applied to what they multiply:
``q·(k_q s_k) = (q·k_q) s_k`` scales a column of the scores, ``p (v_q s_v) = (p s_v)
v_q`` a column of the probabilities, so the products run on the raw e4m3 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    Attributes:
        block_n: KV tokens per tile (a power of two >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loop.
        target_programs: split the context until batch * num_kv_heads * splits reaches
            this many programs (four per SM on an H200's 132 SMs: chosen on the H200,
            see benchmarks/results/attention-h200.md).
        max_splits: upper bound on splits per sequence.
        heads_first: launch order: the KV heads of a sequence next to each other (the
            programs running at once then read whole token rows of the cache), instead
            of one KV head of consecutive sequences. On the H200 at the default tiles:
            within 2% either way at 1-256 rows of 256-640 tokens, 530 against 535-598
            µs at 512 × 1100 (benchmarks/results/kernels-h200.md).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 528
    max_splits: int = 64
    heads_first: bool = True


# NOTE: num_splits follows the batch and the context, stride_bt (the block-table width)
# the longest sequence of the step: specialized (on being 1 or a multiple of 16), each
# new class would compile the kernel again in the middle of serving (a mixed step's
# decode rows run it eagerly). The constexprs left, SINGLE_SPLIT here and SPLITS_PAD in
# the combine kernel, are what warm-up runs (split_classes).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    # q: [GROUP_PAD, D_PAD], the query heads of this KV head group
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < seq_len
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        # kv_off: [BLOCK_N, D_PAD] element offsets of this tile's keys/values
        kv_off = (
            page[:, None] * stride_cb
            + (n % BLOCK_SIZE)[:, None] * stride_cs
            + kvh * stride_ch
            + d[None, :]
        )
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if QUANT:  # each token's key scale multiplies its column of scores
            scale_off = page * stride_sb + (n % BLOCK_SIZE) * stride_ss + kvh
            s *= tl.load(k_scale_ptr + scale_off, mask=nmask, other=0.0)[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))  # s: [GROUP_PAD, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        if QUANT:  # and its value scale its column of probabilities
            p *= tl.load(v_scale_ptr + scale_off, mask=nmask, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SINGLE_SPLIT:
        dst = out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: part_out [batch, num_heads, num_splits, D_PAD], part_lse [batch, num_heads,
        # num_splits]; rows are (batch, head) flattened, contiguous.
        row = b.to(tl.int64) * (GROUP * num_kv_heads) + heads
        part = part_out_ptr + (row[:, None] * num_splits + split) * D_PAD + d[None, :]
        tl.store(part, o, mask=omask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row * num_splits + split, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per (sequence, query head): out = sum_s w_s o_s / sum_s w_s,
    # w_s = 2^(lse_s - max lse).
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(smask & (lse > float("-inf")), w, 0.0)
    o = tl.load(
        part_out_ptr + (row * num_splits + s[:, None]) * D_PAD + d[None, :],
        mask=smask[:, None],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    b = row // num_heads
    h = row % num_heads
    tl.store(
        out_ptr + b * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def num_decode_splits(
    batch: int, num_kv_heads: int, max_seqlen_k: int, config: DecodeConfig
) -> int:
    """Splits per sequence: enough programs to fill the GPU, at least one tile each."""
    tiles = max(1, triton.cdiv(max_seqlen_k, config.block_n))
    want = triton.cdiv(config.target_programs, batch * num_kv_heads)
    return max(1, min(want, tiles, config.max_splits))


def splits_pad(splits: int) -> int:
    """The combine kernel's ``SPLITS_PAD`` for ``splits`` (> 1) splits: the power of two
    at or above it, at least 2."""
    return max(2, triton.next_power_of_2(splits))


def split_classes(num_kv_heads: int, max_context: int,
                  config: DecodeConfig | None = None) -> list[int]:
    """Context lengths (tokens, at most ``max_context``) at which one sequence's decode
    reaches each kernel variant :func:`decode_attention` can launch: one split, and
    each power of two the combine kernel pads the split count to. A batch of more
    sequences splits less, so it reaches no other variant.

    Returns:
        one context length per variant, shortest first.
    """
    config = config or DecodeConfig()
    lengths: dict[int, int] = {}
    for tiles in range(1, max(1, max_context // config.block_n) + 1):
        splits = num_decode_splits(1, num_kv_heads, tiles * config.block_n, config)
        variant = 1 if splits == 1 else splits_pad(splits)
        lengths.setdefault(variant, min(tiles * config.block_n, max(1, max_context)))
    return sorted(lengths.values())


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode step: each sequence's single query attends to its whole paged context.

    Args:
        q: [batch, num_heads, head_dim], fp16/bf16/fp32, last dim contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, q's dtype
            (or float8_e4m3fn with ``key_scale``).
        value_cache: like ``key_cache``.
        block_tables: [batch, max_blocks] int32 block ids of each sequence, in order.
        seq_lens: [batch] int32 context length in tokens (including the new token,
            whose K/V must already be in the cache); each >= 1.
        max_seqlen_k: max of ``seq_lens`` (host int; sizes the split count, no sync).
        scale: softmax scale (usually head_dim ** -0.5).
        out: optional [batch, num_heads, head_dim] output buffer.
        config: launch parameters (defaults: :class:`DecodeConfig`).
        key_scale, value_scale: [num_blocks, block_size, num_kv_heads] float32,
            contiguous: the scales of an fp8 cache (both or neither).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        [batch, num_heads, head_dim] in q's dtype.
    """
    config = config or DecodeConfig()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous"
    assert q.stride(-1) == 1, "q's last dim must be contiguous"
    assert (key_scale is None) == (value_scale is None), "key and value scales go together"
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    scales = (key_scale, value_scale) if key_scale is not None else (key_cache, value_cache)
    if out is None:
        out = torch.empty_like(q)
    splits = num_decode_splits(batch, num_kv_heads, max_seqlen_k, config)
    if splits > 1:
        rows = batch * num_heads * splits
        part_out = torch.empty(rows * d_pad, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(rows, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    launch = launch_options(q.device, pdl)
    grid = (num_kv_heads, batch) if config.heads_first else (batch, num_kv_heads)
    _decode_kernel[(*grid, splits)](
        q,
        key_cache,
        value_cache,
        *scales,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        splits,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_size * num_kv_heads,
        num_kv_heads,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        SINGLE_SPLIT=splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HEADS_FIRST=config.heads_first,
        QUANT=key_scale is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch,
    )
    if splits > 1:
        _combine_kernel[(batch * num_heads,)](
            part_out,
            part_lse,
            out,
            splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=splits_pad(splits),
            **launch,
        )
    return out
