"""The torch backend's by-sequence path (the default on CPU): one SDPA call per
sequence over exactly its context, no padded work, and no launch cost to pay.

Prefill (:func:`prefill_attention_by_sequence`): a sequence without a cached prefix
attends over its new keys/values with ``is_causal``; one with a prefix reads its context
from the cache. Decode (:func:`decode_attention_by_sequence`): one query per sequence,
its group of query heads per KV head against that head's context.

Where each sequence's context lies in the cache is worked out once per step
(:class:`SequenceContexts`): read in place where its blocks are consecutive, else
gathered once per layer into a packed buffer. From an fp8 cache (:mod:`shard.kv_cache`)
a context is read dequantized.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shard.attention.metadata import AttentionMetadata
from shard.kv_cache import KVCacheLayer
from shard.quantization.fp8 import dequantize_rows


def prefill_attention_by_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCacheLayer,
    metadata: AttentionMetadata,
    contexts: SequenceContexts,
    scale: float,
) -> torch.Tensor:
    """Prefill attention one sequence at a time, each over exactly its own context (no
    padding to the longest sequence of the batch).

    A sequence without a cached prefix attends over its new keys/values directly with
    ``is_causal`` (the CPU flash kernel then skips the masked half); one with a prefix
    reads its context from the cache (:class:`SequenceContexts`) and uses a causal mask
    shifted by the prefix length. Used on CPU, where a loop over sequences costs nothing
    next to the padded work it avoids (SmolLM2-135M, prompts of 12-632 tokens: 146 ms → about 15 ms
    per layer on one core).

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
            (already written to ``kv_cache``).
        metadata: prefill metadata (``cu_seqlens_q``, ``seq_lens``, ``block_tables``).
        contexts: the step's :class:`SequenceContexts` of ``metadata``.

    Returns:
        [num_tokens, num_heads, head_dim], the dtype of ``q``.
    """
    cu_q = contexts.cu_q
    seq_lens = contexts.seq_lens
    gathered = contexts.buffers(kv_cache)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = cu_q[i], cu_q[i + 1]
        q_len = end - start
        q_i = q[start:end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        if q_len == seq_len:  # [1, num_kv_heads, seq_len, head_dim] views of k, v
            k_i, v_i = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
            mask, causal = None, True
        else:
            k_i, v_i = contexts.keys_values(kv_cache, i, gathered, q.dtype)
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            q_i,
            k_i.to(q.dtype),
            v_i.to(q.dtype),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def decode_attention_by_sequence(
    q: torch.Tensor, kv_cache: KVCacheLayer, contexts: SequenceContexts, scale: float
) -> torch.Tensor:
    """Decode attention (one query per sequence) with one SDPA call per sequence over
    exactly its context, read in place where its blocks are consecutive.

    The query heads sharing a KV head are passed as that head's queries (``[1,
    num_kv_heads, group, head_dim]`` against ``[1, num_kv_heads, seq_len, head_dim]``),
    so no K/V is repeated for grouped-query attention. Used on CPU, where it is 4x
    faster than the block-by-block batched matmuls of
    :func:`~shard.attention.torch_batched.paged_decode_attention`
    (SmolLM2-135M, batch 8 of 44-664 tokens: 0.47 against 1.9 ms per layer, one core).

    Args:
        q: [batch, num_heads, head_dim].
        kv_cache: the layer's paged cache (the new token already written).
        contexts: the step's :class:`SequenceContexts` (decode metadata).
        scale: softmax scale.

    Returns:
        [batch, num_heads, head_dim], the dtype of ``q``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.key.shape[2]
    gathered = contexts.buffers(kv_cache)
    q_grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    dtype = q.dtype if kv_cache.quantized else kv_cache.key.dtype
    outs = [
        F.scaled_dot_product_attention(
            q_i, *contexts.keys_values(kv_cache, i, gathered, dtype), scale=scale
        )
        for i, q_i in enumerate(q_grouped.to(dtype).split(1))
    ]
    return torch.cat(outs).view(batch, num_heads, head_dim).to(q.dtype)


class SequenceContexts:
    """Where each sequence's context lies in a layer's paged cache, derived once per
    step from the block tables (the same in every layer) by
    :meth:`~shard.attention.torch_backend.TorchAttentionBackend.prepare`.

    Only sequences that read their context from the cache are placed: all of them in
    decode, those with a cached prefix in prefill (the others attend over their new
    keys/values). A sequence whose blocks are consecutive ids is read as a view of the
    cache (no copy); the blocks of the other placed sequences are gathered with one
    ``index_select`` per layer into a packed buffer (allocated once per forward and
    refilled by each layer), and those sequences are views of that buffer.
    """

    def __init__(self, metadata: AttentionMetadata) -> None:
        block_size = metadata.block_size
        tables = metadata.block_tables.tolist()
        self.seq_lens: list[int] = metadata.seq_lens.tolist()
        self.cu_q: list[int] = metadata.cu_seqlens_q.tolist()
        cu_q = self.cu_q
        # per placed sequence: (True, first row in the cache) for a view of the cache, or
        # (False, first row in the gathered buffer)
        self.where: list[tuple[bool, int] | None] = []
        gathered: list[int] = []
        for i, (table, seq_len) in enumerate(zip(tables, self.seq_lens, strict=True)):
            if metadata.is_prefill and cu_q[i + 1] - cu_q[i] == seq_len:
                self.where.append(None)  # no cached prefix: nothing read from the cache
                continue
            blocks = table[: (seq_len + block_size - 1) // block_size]
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                self.where.append((True, blocks[0] * block_size))
            else:
                self.where.append((False, len(gathered) * block_size))
                gathered.extend(blocks)
        self.gather_index = (
            torch.tensor(gathered, dtype=torch.int64, device=metadata.block_tables.device)
            if gathered
            else None
        )
        # one pair per shape and dtype for the forward (cache, and an fp8 cache's
        # scales): a layer's copy is dead once the layer is done
        self._buffers: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, kv_cache: KVCacheLayer) -> Gathered | None:
        """This layer's gathered blocks, key and value each a [num_kv_heads, rows,
        head_dim] view in the cache's layout (see :mod:`shard.kv_cache`), with an fp8
        cache's scales gathered alike (:meth:`KVCacheLayer.scales`), or None when every
        placed sequence is read in place."""
        if self.gather_index is None:
            return None
        scales = kv_cache.scales()
        return (self._gather(kv_cache), None if scales is None else self._gather(scales))

    def _gather(self, kv_cache: KVCacheLayer) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.gather_index
        assert index is not None
        head_major = kv_cache.head_major
        _, block_size, num_kv_heads, head_dim = kv_cache.key.shape
        shape = (
            (num_kv_heads, len(index), block_size * head_dim)
            if head_major
            else (len(index), block_size * num_kv_heads * head_dim)
        )
        key = (shape, kv_cache.key.dtype)
        if key not in self._buffers:
            self._buffers[key] = (kv_cache.key.new_empty(shape), kv_cache.value.new_empty(shape))
        k_buf, v_buf = self._buffers[key]
        return (
            _gather_blocks(kv_cache.key, index, k_buf, head_major),
            _gather_blocks(kv_cache.value, index, v_buf, head_major),
        )

    def keys_values(
        self,
        kv_cache: KVCacheLayer,
        i: int,
        gathered: Gathered | None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of placed sequence ``i``, each a [1, num_kv_heads, seq_len,
        head_dim] view (the layout SDPA takes) of the cache or of ``gathered``, this
        layer's :meth:`buffers`; from an fp8 cache, dequantized into ``dtype`` (None:
        float32) instead."""
        where = self.where[i]
        assert where is not None, f"sequence {i} does not read its context from the cache"
        is_view, row = where
        end = row + self.seq_lens[i]
        scales = kv_cache.scales()
        if is_view:
            key, value = kv_cache.heads_view()
            key_scale, value_scale = scales.heads_view() if scales is not None else (key, value)
        else:
            assert gathered is not None
            (key, value), gathered_scales = gathered
            key_scale, value_scale = gathered_scales or (key, value)
        key, value = key[None, :, row:end], value[None, :, row:end]
        if scales is None:
            return key, value
        dtype = dtype or torch.float32
        return (
            dequantize_rows(key, key_scale[None, :, row:end, 0], dtype),
            dequantize_rows(value, value_scale[None, :, row:end, 0], dtype),
        )


# gathered (key, value) blocks, and an fp8 cache's gathered (key scale, value scale)
Gathered = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


def _gather_blocks(
    cache: torch.Tensor, index: torch.Tensor, out: torch.Tensor, head_major: bool
) -> torch.Tensor:
    """Copy the blocks ``index`` of ``cache`` (a layer's key or value) into ``out``,
    whole blocks in the cache's layout (per KV head when head-major); returns ``out`` as
    [num_kv_heads, rows, head_dim]."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    if head_major:  # the storage is [num_kv_heads, num_blocks, block_size, head_dim]
        source = cache.permute(2, 0, 1, 3).view(num_kv_heads, num_blocks, -1)
        torch.index_select(source, 1, index, out=out)
        return out.view(num_kv_heads, -1, head_dim)
    torch.index_select(cache.view(num_blocks, -1), 0, index, out=out)
    return out.view(-1, num_kv_heads, head_dim).transpose(0, 1)
