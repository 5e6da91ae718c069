"""The torch backend's batched path (the default off CPU): one kernel for the batch.

Prefill (:func:`padded_prefill_attention`): keys/values of each sequence are gathered
through its block table into a padded ``[batch, max_seqlen_k]`` view, queries are
scattered into a padded ``[batch, max_seqlen_q]`` view, and
``torch.nn.functional.scaled_dot_product_attention`` runs with an explicit boolean mask
that is causal with each sequence's cached-prefix offset and hides padding
(:func:`attention_mask`). Decode (one query per sequence) reads only the blocks each
sequence uses and combines per-block softmax partials
(:func:`paged_decode_attention`); a lone sequence is one gather and two matmuls
(:func:`single_decode_attention`).

An fp8 cache (:mod:`shard.kv_cache`) is read dequantized as its blocks are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shard.attention.metadata import AttentionMetadata
from shard.kv_cache import KVCacheLayer
from shard.quantization.fp8 import dequantize_rows

# NOTE: cuDNN attention is left out: it builds a new graph for every new key length
# (every decode step), which cost ~4.5 ms of CPU per layer on an H200.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def padded_prefill_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Prefill attention of the whole batch in one SDPA call over padded views.

    Args:
        q: [num_tokens, num_heads, head_dim].
        kv_cache: the layer's paged cache (the new tokens already written).
        metadata: prefill metadata (``cu_seqlens_q``, ``seq_lens``, ``block_tables``,
            ``max_seqlen_q``, ``max_seqlen_k``).
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim], the dtype of ``q``.
    """
    keys, values = gather_kv(kv_cache, metadata.block_tables, metadata.max_seqlen_k)
    seq_idx, q_offset = token_layout(metadata)
    batch = metadata.num_seqs
    max_q = metadata.max_seqlen_q
    # q_pad: [batch, num_heads, max_q, head_dim]
    q_pad = q.new_zeros(batch, max_q, q.shape[1], q.shape[2])
    q_pad[seq_idx, q_offset] = q
    q_pad = q_pad.transpose(1, 2)
    mask = attention_mask(metadata)  # [batch, 1, max_q, max_k]
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q_pad,
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[2],
        )
    return out.transpose(1, 2)[seq_idx, q_offset]


def single_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention of one sequence over its whole gathered context.

    Args:
        q: [1, num_heads, head_dim].
        keys, values: [1, seq_len, num_kv_heads, head_dim].
        scale: softmax scale.

    Returns:
        [1, num_heads, head_dim], the dtype of ``q``. Softmax in float32.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    q_grouped = q.view(num_kv_heads, num_heads // num_kv_heads, head_dim)
    k = keys[0].to(q.dtype).transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
    v = values[0].to(q.dtype).transpose(0, 1)
    probs = torch.softmax(torch.matmul(q_grouped, k.transpose(1, 2)).float() * scale, dim=-1)
    return torch.matmul(probs.to(q.dtype), v).reshape(1, num_heads, head_dim)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context (decode), block by block.

    Only the blocks a sequence uses are read (no padding to the longest context): each
    (sequence, block) pair is one row of a batched matmul; the softmax over a sequence's
    blocks is combined with a per-sequence max and sum, as in split-KV attention
    (Flash-Decoding). Scores and the softmax run in float32.

    Args:
        q: [batch, num_heads, head_dim].
        kv_cache: the layer's paged cache, [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [batch, max_blocks] int32.
        seq_lens: [batch] context length of each sequence, tokens (>= 1).
        scale: softmax scale.

    Returns:
        [batch, num_heads, head_dim], the dtype of ``q``.
    """
    batch, num_heads, head_dim = q.shape
    block_size = kv_cache.block_size
    num_kv_heads = kv_cache.key.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    lens = seq_lens.long()
    slot = torch.arange(block_tables.shape[1], device=device)
    used = slot[None, :] < (lens[:, None] + block_size - 1) // block_size  # [batch, max_blocks]
    seq_of = torch.arange(batch, device=device)[:, None].expand_as(used)[used]  # [pairs]
    first_pos = (slot[None, :] * block_size).expand_as(used)[used]  # [pairs]
    blocks = block_tables[used].long()
    # k/v: [pairs, num_kv_heads, block_size, head_dim], gathered through a transposed view.
    k = kv_cache.key.transpose(1, 2)[blocks].to(q.dtype)
    v = kv_cache.value.transpose(1, 2)[blocks].to(q.dtype)
    scales = kv_cache.scales()
    if scales is not None:
        k = dequantize_rows(k, scales.key.transpose(1, 2)[blocks][..., 0], q.dtype)
        v = dequantize_rows(v, scales.value.transpose(1, 2)[blocks][..., 0], q.dtype)
    q_pairs = q.view(batch, num_kv_heads, group, head_dim)[seq_of]  # [pairs, kv, group, d]
    scores = torch.matmul(q_pairs, k.transpose(2, 3)).float() * scale  # [pairs, kv, g, bs]
    positions = first_pos[:, None] + torch.arange(block_size, device=device)[None, :]
    beyond = positions >= lens[seq_of][:, None]  # [pairs, block_size]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    pair_max = scores.amax(dim=-1)  # [pairs, kv, group]
    index = seq_of[:, None, None].expand_as(pair_max)
    seq_max = torch.full((batch, num_kv_heads, group), float("-inf"), device=device)
    seq_max = seq_max.scatter_reduce(0, index, pair_max, reduce="amax")
    weights = torch.exp(scores - seq_max[seq_of][..., None])  # [pairs, kv, group, bs]
    denom = torch.zeros_like(seq_max).index_add_(0, seq_of, weights.sum(dim=-1))
    partial = torch.matmul(weights.to(v.dtype), v).float()  # [pairs, kv, group, d]
    out = torch.zeros(batch, num_kv_heads, group, head_dim, device=device)
    out.index_add_(0, seq_of, partial)
    return (out / denom[..., None]).to(q.dtype).reshape(batch, num_heads, head_dim)


def gather_kv(
    kv_cache: KVCacheLayer, block_tables: torch.Tensor, max_seqlen_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's context through its block table.

    Args:
        block_tables: [batch, max_blocks] int32.
        max_seqlen_k: tokens to keep per sequence (<= max_blocks * block_size).

    Returns:
        (keys, values), each [batch, max_seqlen_k, num_kv_heads, head_dim], in the
        cache's dtype (float32, dequantized, from an fp8 cache); positions beyond a
        sequence's seq_len hold whatever the padded blocks contain.
    """
    batch, max_blocks = block_tables.shape
    bt = block_tables.long()
    keys = kv_cache.key[bt].reshape(
        batch, max_blocks * kv_cache.block_size, *kv_cache.key.shape[2:]
    )
    values = kv_cache.value[bt].reshape(
        batch, max_blocks * kv_cache.block_size, *kv_cache.value.shape[2:]
    )
    scales = kv_cache.scales()
    if scales is not None:
        key_scales, value_scales = gather_kv(scales, block_tables, max_seqlen_k)
        return (
            dequantize_rows(keys[:, :max_seqlen_k], key_scales[..., 0], torch.float32),
            dequantize_rows(values[:, :max_seqlen_k], value_scales[..., 0], torch.float32),
        )
    return keys[:, :max_seqlen_k], values[:, :max_seqlen_k]


def token_layout(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new token: its sequence index and its offset among that sequence's new
    tokens. Both [num_tokens] int64."""
    cu_q = metadata.cu_seqlens_q.long()
    q_lens = cu_q[1:] - cu_q[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(metadata.num_seqs, device=cu_q.device), q_lens)
    q_offset = torch.arange(metadata.num_tokens, device=cu_q.device) - cu_q[seq_idx]
    return seq_idx, q_offset


def attention_mask(metadata: AttentionMetadata) -> torch.Tensor:
    """Boolean mask [batch, 1, max_seqlen_q, max_seqlen_k] (True = attend).

    Query ``j`` of sequence ``i`` sits at absolute position ``seq_lens[i] - q_len_i + j``
    and sees keys at positions ``<=`` that. Padded query rows (``j >= q_len_i``) see key
    0 only so their softmax stays finite; their outputs are discarded.
    """
    cu_q = metadata.cu_seqlens_q.long()
    q_lens = (cu_q[1:] - cu_q[:-1])[:, None, None]
    seq_lens = metadata.seq_lens.long()[:, None, None]
    device = cu_q.device
    j = torch.arange(metadata.max_seqlen_q, device=device)[None, :, None]
    kpos = torch.arange(metadata.max_seqlen_k, device=device)[None, None, :]
    qpos = seq_lens - q_lens + j
    mask = kpos <= qpos
    mask = torch.where(j < q_lens, mask, kpos == 0)
    return mask[:, None]
