"""Pure-PyTorch attention over a paged KV cache: the reference every other backend is
tested against. Runs on CPU and GPU, with two paths.

Batched (the default off CPU). Prefill: keys/values of each sequence are gathered
through its block table into a padded ``[batch, max_seqlen_k]`` view, queries are
scattered into a padded ``[batch, max_seqlen_q]`` view, and
``torch.nn.functional.scaled_dot_product_attention`` runs with an explicit boolean mask
that is causal with each sequence's cached-prefix offset and hides padding. Decode (one
query per sequence) reads only the blocks each sequence uses and combines per-block
softmax partials (:func:`paged_decode_attention`).

By sequence (the default on CPU): one SDPA call per sequence over exactly its context,
read in place where its blocks are consecutive (:func:`prefill_attention_by_sequence`,
:func:`decode_attention_by_sequence`). No padded work, and no launch cost to pay.

An fp8 cache (:mod:`shard.kv_cache`) is read dequantized, each sequence's context as it
is gathered, and a prefill's new tokens are attended as the cache holds them
(:meth:`KVCacheLayer.read_back`), as our Triton kernels read them from the cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shard.attention.base import AttentionBackend, AttentionSpec
from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer

# NOTE: cuDNN attention is left out: it builds a new graph for every new key length
# (every decode step), which cost ~4.5 ms of CPU per layer on an H200.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttentionBackend(AttentionBackend):
    """Reference backend (SDPA with an explicit mask; GQA through ``enable_gqa``)."""

    name = "torch"
    block_size_multiple = 1

    def __init__(self, by_sequence: bool | None = None,
                 kernels: KernelChoices | None = None) -> None:
        """``by_sequence``: attend one sequence at a time over exactly its context
        (:func:`prefill_attention_by_sequence`, :func:`decode_attention_by_sequence`)
        instead of batched over padded or block-split contexts. None (default) chooses
        per step: by sequence on CPU, batched elsewhere (one kernel for the batch).
        ``kernels``: unused (no kernel of ours runs here)."""
        super().__init__(kernels)
        self.by_sequence = by_sequence
        # this step's metadata and, on the by-sequence path, its contexts (see prepare)
        self._metadata: AttentionMetadata | None = None
        self._contexts: SequenceContexts | None = None

    def _by_sequence(self, device: torch.device) -> bool:
        return device.type == "cpu" if self.by_sequence is None else self.by_sequence

    def kv_head_major(self, device: torch.device) -> bool:
        """Head-major on the by-sequence path: each sequence's keys and values are then
        one contiguous stretch per KV head where its blocks are consecutive (and in the
        gathered buffer where not), which the CPU's SDPA kernel reads faster than rows
        of interleaved heads (SmolLM2-135M's 3 KV heads of 64, one EPYC core: 77
        against 109 µs per call over 300 tokens, 146 against 254 over 700; 2026-12-03)."""
        return self._by_sequence(device)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        return True, "pure PyTorch reference backend: runs on any device and dtype"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """On the by-sequence path: place every sequence's context in the cache once for
        the step (:class:`SequenceContexts`; it reads the block tables on the host)."""
        self._metadata = metadata
        by_sequence = self._by_sequence(metadata.seq_lens.device)
        self._contexts = SequenceContexts(metadata) if by_sequence else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert metadata is self._metadata, "prepare(metadata) must run before forward"
        kv_cache.write(k, v, metadata.slot_mapping, metadata.has_skipped_slots)
        k, v = kv_cache.read_back(k, v)
        contexts = self._contexts
        if not metadata.is_prefill:
            if contexts is not None:
                return decode_attention_by_sequence(q, kv_cache, contexts, scale)
            if metadata.num_seqs == 1:  # nothing to pad: one gather, two matmuls
                keys, values = gather_kv(kv_cache, metadata.block_tables, metadata.max_seqlen_k)
                return single_decode_attention(q, keys, values, scale)
            return paged_decode_attention(q, kv_cache, metadata.block_tables, metadata.seq_lens,
                                          scale)
        if contexts is not None:
            return prefill_attention_by_sequence(q, k, v, kv_cache, metadata, contexts, scale)
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


class SequenceContexts:
    """Where each sequence's context lies in a layer's paged cache, derived once per
    step from the block tables (the same in every layer) by
    :meth:`TorchAttentionBackend.prepare`.

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
        shape = ((num_kv_heads, len(index), block_size * head_dim) if head_major
                 else (len(index), block_size * num_kv_heads * head_dim))
        key = (shape, kv_cache.key.dtype)
        if key not in self._buffers:
            self._buffers[key] = (kv_cache.key.new_empty(shape), kv_cache.value.new_empty(shape))
        k_buf, v_buf = self._buffers[key]
        return (_gather_blocks(kv_cache.key, index, k_buf, head_major),
                _gather_blocks(kv_cache.value, index, v_buf, head_major))

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
        return (_dequantize(key, key_scale[None, :, row:end], dtype),
                _dequantize(value, value_scale[None, :, row:end], dtype))


# gathered (key, value) blocks, and an fp8 cache's gathered (key scale, value scale)
Gathered = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


def _dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``x`` [..., head_dim] times ``scale`` [..., 1] (a head_dim-1 view of the
    scales, see :meth:`KVCacheLayer.scales`), in ``dtype``."""
    return (x.to(torch.float32) * scale).to(dtype)


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


def decode_attention_by_sequence(
    q: torch.Tensor, kv_cache: KVCacheLayer, contexts: SequenceContexts, scale: float
) -> torch.Tensor:
    """Decode attention (one query per sequence) with one SDPA call per sequence over
    exactly its context, read in place where its blocks are consecutive.

    The query heads sharing a KV head are passed as that head's queries (``[1,
    num_kv_heads, group, head_dim]`` against ``[1, num_kv_heads, seq_len, head_dim]``),
    so no K/V is repeated for grouped-query attention. Used on CPU, where it is 4x
    faster than the block-by-block batched matmuls of :func:`paged_decode_attention`
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
        k = _dequantize(k, scales.key.transpose(1, 2)[blocks], q.dtype)
        v = _dequantize(v, scales.value.transpose(1, 2)[blocks], q.dtype)
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
        return (_dequantize(keys[:, :max_seqlen_k], key_scales, torch.float32),
                _dequantize(values[:, :max_seqlen_k], value_scales, torch.float32))
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
