"""Write new keys/values into the paged KV cache by slot mapping (PagedAttention,
Kwon et al. 2023: slot = block_id * block_size + offset)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start


@triton.jit
def _cache_write_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ELEMS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per new token: copy its num_kv_heads * head_dim keys and values.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    e = tl.arange(0, ELEMS_PAD)
    head = e // HEAD_DIM
    d = e % HEAD_DIM
    # NOTE: compare a broadcast slot, not the scalar: the interpreter rejects a mask
    # built from a scalar bool.
    mask = (e < NUM_KV_HEADS * HEAD_DIM) & ((e * 0 + slot) >= 0)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + head * stride_vh + d, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + e
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> None:
    """Store ``k``/``v`` of each new token at its cache slot, skipping slots < 0.

    Unlike :meth:`shard.kv_cache.KVCacheLayer.write` this never synchronises with the
    host (negative slots are masked in the kernel), so it can be captured in a graph.

    Args:
        k: [num_tokens, num_kv_heads, head_dim], any float dtype, last dim contiguous.
        v: [num_tokens, num_kv_heads, head_dim], like ``k``.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; written
            in its own dtype.
        value_cache: like ``key_cache``.
        slot_mapping: [num_tokens] int64 slot of each token; < 0 means "do not write".
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v last dim must be contiguous"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), "k/v do not match the cache"
    if num_tokens == 0:
        return
    _cache_write_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ELEMS_PAD=triton.next_power_of_2(num_kv_heads * head_dim),
        **launch_options(k.device, pdl),
    )
