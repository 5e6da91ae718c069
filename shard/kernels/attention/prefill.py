"""Variable-length causal prefill over a paged KV cache.

Algorithm: FlashAttention-2 (Dao 2023) forward — tiles of queries, online softmax over
tiles of keys, one normalisation at the end — with keys/values read through block
tables (PagedAttention, Kwon et al. 2023). Sequence ``i`` has ``q_len_i`` new tokens,
the last of its ``seq_lens[i]`` context tokens; the first ``seq_lens[i] - q_len_i`` are a
prefix already in the cache. The new tokens' K/V must be in the cache too (write them
first), so every key is read from the cache. A step whose sequences have no cached
prefix can instead pass the new tokens' K/V as they are (``new_kv``): keys are then
read in token order, without the block-table indirection. Both read the same values in
the same tile order, so a sequence's result is the same bits either way (whatever else
is in its batch decides the source).

The causal mask is bottom-right aligned: query ``j`` sits at position
``seq_lens[i] - q_len_i + j`` and sees keys ``0..`` that position. Key tiles entirely
below a query tile's first position run unmasked; only the tiles on the diagonal mask.

From an fp8 cache the keys and values are dequantized in registers as the decode kernel
does (:mod:`.decode`): each token's scales applied to its column of scores and of
probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard.kernels.attention.decode import LOG2E
from shard.kernels.pdl import launch_options, pdl_start


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel.

    Attributes:
        block_m: query tokens per program (power of two >= 16).
        block_n: key tokens per tile (power of two >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
    """

    # Defaults: with keys from the new K/V, the fastest of 36 configurations at every
    # point measured on the H200 (16 × 1024 to 4 × 4096 and 128 × 128 tokens), and
    # within 3% of the best through the cache (benchmarks/results/kernels-h200.md).
    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, qpos, seq_len, d,
    dmask, scale_log2, stride_kb, stride_kt, stride_kh, stride_sb, stride_ss,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    """One online-softmax step over keys ``[start, start + BLOCK_N)``: through the block
    table (``PAGED``), or at token ``n`` of ``k_ptr``, already offset to the sequence;
    with ``QUANT`` (paged only) fp8 keys and values scaled by ``ks_ptr`` / ``vs_ptr``."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < seq_len
    if PAGED:
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = page * stride_kb + (n % BLOCK_SIZE) * stride_kt
        scale_off = page * stride_sb + (n % BLOCK_SIZE) * stride_ss + kvh
    else:
        row = n.to(tl.int64) * stride_kt
        scale_off = row  # unused: the new K/V are never fp8
    kv_off = row[:, None] + kvh * stride_kh + d[None, :]
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if QUANT:
        s *= tl.load(ks_ptr + scale_off, mask=nmask, other=0.0)[None, :]
    if MASKED:
        s = tl.where((n[None, :] <= qpos[:, None]) & nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    if QUANT:
        p *= tl.load(vs_ptr + scale_off, mask=nmask, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# NOTE: stride_bt is the block-table width, which changes with the batch: specialized
# (on divisibility by 16, or 1), each new width class would compile the kernel again in
# the middle of serving, seconds after warm-up.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    m_tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    qpos = prefix + rows
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    # Key range: [0, full_end) is visible to every row of this tile (no mask);
    # [full_end, hi) straddles the diagonal. An empty tile (m_tile * BLOCK_M >= q_len)
    # runs no iteration and stores nothing.
    valid = m_tile * BLOCK_M < q_len
    first_pos = prefix + m_tile * BLOCK_M
    full_end = tl.where(valid, ((first_pos + 1) // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(valid, tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if not PAGED:  # no prefix: the sequence's keys are its new tokens
        k_ptr += q_start.to(tl.int64) * stride_kt
        v_ptr += q_start.to(tl.int64) * stride_kt
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, qpos,
            seq_len, d, dmask, scale_log2, stride_kb, stride_kt, stride_kh, stride_sb,
            stride_ss, BLOCK_SIZE, BLOCK_N, False, PAGED, DOT_PRECISION, QUANT,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, qpos,
            seq_len, d, dmask, scale_log2, stride_kb, stride_kt, stride_kh, stride_sb,
            stride_ss, BLOCK_SIZE, BLOCK_N, True, PAGED, DOT_PRECISION, QUANT,
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Causal attention of a flattened batch of new tokens over their paged contexts.

    Args:
        q: [num_tokens, num_heads, head_dim], fp16/bf16/fp32, last dim contiguous; the
            new tokens of all sequences, concatenated in batch order.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, q's
            dtype (or float8_e4m3fn with ``key_scale``); already holds every context
            token, the new ones included.
        value_cache: like ``key_cache``.
        block_tables: [batch, max_blocks] int32.
        cu_seqlens_q: [batch + 1] int32 prefix sums of the new-token counts.
        seq_lens: [batch] int32 context lengths in tokens (cached prefix + new tokens).
        max_seqlen_q: max new tokens of one sequence (host int; sizes the grid).
        scale: softmax scale.
        out: optional [num_tokens, num_heads, head_dim] output buffer.
        config: launch parameters (defaults: :class:`PrefillConfig`).
        new_kv: optional (k, v), each [num_tokens, num_kv_heads, head_dim] with equal
            strides and a contiguous last dim (e.g. views of the QKV projection's
            output), the new tokens' keys (rotated) and values: attention reads them
            instead of the cache. Only for steps where no sequence has a cached prefix
            (``seq_lens`` equal to the new-token counts; not checked, a host read).
        key_scale, value_scale: [num_blocks, block_size, num_kv_heads] float32,
            contiguous: the scales of an fp8 cache (both or neither; not with
            ``new_kv``).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        [num_tokens, num_heads, head_dim] in q's dtype.
    """
    config = config or PrefillConfig()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    batch = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous"
    assert q.stride(-1) == 1, "q's last dim must be contiguous"
    assert (key_scale is None) == (value_scale is None), "key and value scales go together"
    assert key_scale is None or new_kv is None, "new_kv is never fp8"
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    scales = (key_scale, value_scale) if key_scale is not None else (key_cache, value_cache)
    if new_kv is None:
        keys, values = key_cache, value_cache
        kv_strides = key_cache.stride()[:3]
    else:
        keys, values = new_kv
        assert keys.stride() == values.stride() and keys.stride(-1) == 1, "new_kv strides"
        assert keys.shape == (num_tokens, num_kv_heads, head_dim), "new_kv shape"
        kv_strides = (0, *keys.stride()[:2])
    grid = (triton.cdiv(max_seqlen_q, config.block_m), batch, num_heads)
    _prefill_kernel[grid](
        q,
        keys,
        values,
        *scales,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *kv_strides,
        block_size * num_kv_heads,
        num_kv_heads,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PAGED=new_kv is None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QUANT=key_scale is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(q.device, pdl),
    )
    return out
