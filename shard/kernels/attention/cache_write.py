"""Write new keys/values into the paged KV cache by slot mapping (PagedAttention,
Kwon et al. 2023: slot = block_id * block_size + offset); into an fp8 cache quantized,
each head vector with its own scale (:mod:`shard.kv_cache`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start

# constexpr: a compiled kernel reads no other module global
FP8_MAX = tl.constexpr(448.0)  # largest float8 e4m3fn value
MIN_SCALE = tl.constexpr(1e-12)  # shard.quantization.fp8.MIN_SCALE


@triton.jit
def round_to_e4m3(x):
    """``x`` (float32, |x| <= 448) rounded to the nearest float8 e4m3 value, ties to
    even, in float32: its conversion to e4m3 is then exact.

    NOTE: the same value as the conversion's own rounding on a GPU; done here because
    Triton's CPU interpreter truncates where a rounding carries into the next power of
    two (127.9 becomes 64, not 128). Spacing of e4m3 values around x: 2^(e - 3) for
    x's exponent e, 2^-9 below 2^-6 (subnormals); adding and subtracting 1.5 x 2^23
    rounds a float32 of magnitude < 2^22 to an integer, ties to even.
    """
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    spacing = (tl.maximum(exponent - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)
    return ((x / spacing + 12582912.0) - 12582912.0) * spacing


@triton.jit
def store_head_vectors(cache_ptr, scale_ptr, x, dst, scale_dst, mask, head_mask,
                       QUANT: tl.constexpr):
    """Store ``x`` [heads, d] (float32) at ``cache_ptr + dst``; into an fp8 cache (QUANT)
    divided by each row's scale ``amax / 448``, which goes to ``scale_ptr + scale_dst``
    [heads]. Rows outside ``head_mask`` [heads] / elements outside ``mask`` are skipped
    (their values must be 0)."""
    if QUANT:
        scale = tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX, MIN_SCALE)
        x = round_to_e4m3(tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX))
        tl.store(scale_ptr + scale_dst, scale, mask=head_mask)
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cache_write_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per new token: its [num_kv_heads, head_dim] keys and values.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, D_PAD)
    # NOTE: compare a broadcast slot, not the scalar: the interpreter rejects a mask
    # built from a scalar bool.
    head_mask = (h < NUM_KV_HEADS) & ((h * 0 + slot) >= 0)
    mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    scale_dst = slot * NUM_KV_HEADS + h
    store_head_vectors(key_cache_ptr, key_scale_ptr, k, dst, scale_dst, mask, head_mask, QUANT)
    store_head_vectors(value_cache_ptr, value_scale_ptr, v, dst, scale_dst, mask, head_mask,
                       QUANT)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> None:
    """Store ``k``/``v`` of each new token at its cache slot, skipping slots < 0; into an
    fp8 cache (``key_scale`` given) quantized per token and head, as
    :meth:`shard.kv_cache.KVCacheLayer.write` does.

    Unlike :meth:`shard.kv_cache.KVCacheLayer.write` this never synchronises with the
    host (negative slots are masked in the kernel), so it can be captured in a graph.

    Args:
        k: [num_tokens, num_kv_heads, head_dim], any float dtype, last dim contiguous.
        v: [num_tokens, num_kv_heads, head_dim], like ``k``.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; written
            in its own dtype.
        value_cache: like ``key_cache``.
        slot_mapping: [num_tokens] int64 slot of each token; < 0 means "do not write".
        key_scale, value_scale: [num_blocks, block_size, num_kv_heads] float32,
            contiguous, the scales of an fp8 cache (both or neither).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v last dim must be contiguous"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), "k/v do not match the cache"
    assert (key_scale is None) == (value_scale is None), "key and value scales go together"
    if num_tokens == 0:
        return
    _cache_write_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        QUANT=key_scale is not None,
        **launch_options(k.device, pdl),
    )
