"""From the QKV projection's output to attention's inputs in one kernel: per-head q/k
RMSNorm (Qwen3's ``qk_norm``; skipped when no weights are given), rotary embeddings
(RoFormer, Su et al. 2021, ``rotate_half`` convention) on q and k, and the paged KV cache
write of k and v by slot mapping (PagedAttention, Kwon et al. 2023).

Eagerly these are four to six kernels per layer (two norms, rotary, the cache write);
in a batch-1 decode step of a 32-layer model each costs a launch-sized slice of GPU time
whatever its size, so one kernel instead saves ~100 launches a step.

Into an fp8 cache the keys and values are quantized as they are written, each head
vector with its own scale (:mod:`shard.kv_cache`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.attention.cache_write import FP8_MAX, MIN_SCALE, round_to_e4m3
from shard.kernels.pdl import launch_options, pdl_start


@triton.jit
def _rotate(x1, x2, cos_ptr, sin_ptr, w1, w2, d, in_half, eps, HEAD_DIM: tl.constexpr,
            HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    # x1, x2: [heads, HALF_PAD] float32 halves of each head; returns them rotated.
    if HAS_NORM:
        # Hugging Face's numerics: normalise in float32, round to the activations'
        # dtype, multiply by the weight in that dtype
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        x1 = (w1[None, :] * (x1 * r).to(dtype)).to(dtype).to(tl.float32)
        x2 = (w2[None, :] * (x2 * r).to(dtype)).to(dtype).to(tl.float32)
    cos1 = tl.load(cos_ptr + d, mask=in_half, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + HALF + d, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + d, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + HALF + d, mask=in_half, other=0.0).to(tl.float32)[None, :]
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _store_halves(cache_ptr, scale_ptr, x1, x2, dst, scale_dst, mask, head_mask,
                  HALF: tl.constexpr, QUANT: tl.constexpr):
    # x1, x2: [heads, HALF_PAD] float32 halves of each head vector, stored at dst and
    # dst + HALF; into an fp8 cache (QUANT) divided by the vector's scale amax / 448,
    # stored at scale_ptr + scale_dst [heads].
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)
        x1 = round_to_e4m3(tl.clamp(x1 / scale[:, None], -FP8_MAX, FP8_MAX))
        x2 = round_to_e4m3(tl.clamp(x2 / scale[:, None], -FP8_MAX, FP8_MAX))
        tl.store(scale_ptr + scale_dst, scale, mask=head_mask)
    tl.store(cache_ptr + dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + dst + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    q_out_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_mapping_ptr,
    stride_qkv_t,
    stride_q_out_t,
    stride_rope_t,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    K_IN_PLACE: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per (token, part): part 0 = the q heads, 1 = the k heads, 2 = the v
    # heads, each a [heads, head_dim / 2] tile per half of head_dim.
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    d = tl.arange(0, HALF_PAD)
    in_half = d < HALF
    dtype = q_out_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv_t
    rope = t * stride_rope_t
    # NOTE: each branch uses names of its own: Triton merges the names that both sides
    # of a runtime branch assign, which needs equal types (and never a dtype object).
    if part == 0:
        qh = tl.arange(0, HEADS_PAD)
        q_mask = (qh < NUM_HEADS)[:, None] & in_half[None, :]
        q_src = row + qh[:, None] * HEAD_DIM + d[None, :]
        q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
        qw1 = tl.load(q_weight_ptr + d, mask=in_half, other=0.0)
        qw2 = tl.load(q_weight_ptr + HALF + d, mask=in_half, other=0.0)
        q_out1, q_out2 = _rotate(q1, q2, cos_ptr + rope, sin_ptr + rope, qw1, qw2, d, in_half,
                                 eps, HEAD_DIM, HALF, HAS_NORM, dtype)
        q_dst = q_out_ptr + t * stride_q_out_t + qh[:, None] * HEAD_DIM + d[None, :]
        tl.store(q_dst, q_out1.to(dtype), mask=q_mask)
        tl.store(q_dst + HALF, q_out2.to(dtype), mask=q_mask)
    else:
        kvh = tl.arange(0, KV_HEADS_PAD)
        slot = tl.load(slot_mapping_ptr + t)
        head_mask = (kvh < NUM_KV_HEADS)[:, None] & in_half[None, :]
        # NOTE: a broadcast slot, not the scalar: the interpreter rejects a scalar mask.
        written = (kvh < NUM_KV_HEADS) & ((kvh * 0 + slot) >= 0)
        kv_mask = head_mask & written[:, None]
        first = (NUM_HEADS + (part - 1) * NUM_KV_HEADS) * HEAD_DIM  # k, then v
        kv_src = row + first + kvh[:, None] * HEAD_DIM + d[None, :]
        kv_dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kvh[:, None] * HEAD_DIM + d[None, :]
        scale_dst = slot * NUM_KV_HEADS + kvh
        if part == 1:
            k1 = tl.load(kv_src, mask=head_mask, other=0.0).to(tl.float32)
            k2 = tl.load(kv_src + HALF, mask=head_mask, other=0.0).to(tl.float32)
            kw1 = tl.load(k_weight_ptr + d, mask=in_half, other=0.0)
            kw2 = tl.load(k_weight_ptr + HALF + d, mask=in_half, other=0.0)
            k_out1, k_out2 = _rotate(k1, k2, cos_ptr + rope, sin_ptr + rope, kw1, kw2, d,
                                     in_half, eps, HEAD_DIM, HALF, HAS_NORM, dtype)
            _store_halves(key_cache_ptr, key_scale_ptr, k_out1, k_out2, kv_dst, scale_dst,
                          kv_mask, written, HALF, QUANT)
            if K_IN_PLACE:
                tl.store(kv_src, k_out1.to(dtype), mask=head_mask)
                tl.store(kv_src + HALF, k_out2.to(dtype), mask=head_mask)
        else:  # v: copied to the cache as it is (or quantized)
            v1 = tl.load(kv_src, mask=kv_mask, other=0.0).to(tl.float32)
            v2 = tl.load(kv_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
            _store_halves(value_cache_ptr, value_scale_ptr, v1, v2, kv_dst, scale_dst,
                          kv_mask, written, HALF, QUANT)


def rope_write(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_in_place: bool = False,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotate (after RMS-normalising each head when weights are given) the queries and
    keys of ``qkv``; write keys and values into the paged cache; return the queries.

    Same result as ``rms_norm`` per head (:func:`shard.layers.fused.rms_norm`),
    :func:`shard.layers.fused.apply_rotary` and :func:`.cache_write.write_kv_cache`
    one after the other, up to rounding: the rotation runs in float32 and is rounded once.
    Never synchronises with the host, so it can be captured in a CUDA graph.

    Args:
        qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the projection's
            output (q heads, then k heads, then v heads); last dim contiguous.
        cos, sin: [num_tokens, 1 or absent, head_dim] rotary cos/sin of each token's
            position (:class:`shard.layers.rotary.RotaryEmbedding`), last dim contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
            contiguous; written in their own dtype.
        slot_mapping: [num_tokens] int64 cache slot of each token; < 0: not written.
        q_weight, k_weight: [head_dim] per-head RMSNorm weights (both or neither).
        eps: RMSNorm epsilon.
        k_in_place: also write the rotated keys back over qkv's k heads (every token,
            written to the cache or not), so a prefill can read them from there
            (:func:`.prefill.prefill_attention`'s ``new_kv``).
        key_scale, value_scale: [num_blocks, block_size, num_kv_heads] float32,
            contiguous: the scales of an fp8 cache (both or neither), whose keys and
            values are quantized per token and head as they are written.
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        [num_tokens, num_heads, head_dim] rotated queries, qkv's dtype.
    """
    num_tokens = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width"
    assert head_dim % 2 == 0, "rotary needs an even head_dim"
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous"
    assert key_cache.shape[2] == num_kv_heads, "cache heads"
    assert (q_weight is None) == (k_weight is None), "q and k norm weights go together"
    assert (key_scale is None) == (value_scale is None), "key and value scales go together"
    q = torch.empty(num_tokens, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    if num_tokens == 0:
        return q
    cos = cos.reshape(num_tokens, head_dim)
    sin = sin.reshape(num_tokens, head_dim)
    has_norm = q_weight is not None
    _rope_write_kernel[(num_tokens, 3)](
        qkv,
        q,
        cos,
        sin,
        q_weight if has_norm else q,
        k_weight if has_norm else q,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        slot_mapping,
        qkv.stride(0),
        q.stride(0),
        cos.stride(0),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=has_norm,
        K_IN_PLACE=k_in_place,
        QUANT=key_scale is not None,
        **launch_options(qkv.device, pdl),
    )
    return q
