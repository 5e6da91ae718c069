"""The attention module a model layer calls: holds the backend and this layer's KV
cache, which the model runner binds after allocating the cache."""

from __future__ import annotations

import torch
from torch import nn

from shard.attention.base import AttentionBackend
from shard.attention.metadata import AttentionMetadata
from shard.kv_cache import KVCacheLayer
from shard.layers.fused import apply_rotary
from shard.layers.norm import RMSNorm


class Attention(nn.Module):
    """Paged attention for one layer.

    Args:
        backend: the shard's attention backend.
        num_heads: query heads on this rank.
        num_kv_heads: key/value heads on this rank.
        head_dim: per-head dimension.
        scale: softmax scale.
    """

    def __init__(
        self,
        backend: AttentionBackend,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ):
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: KVCacheLayer | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        → [num_tokens, num_heads, head_dim].

        Raises:
            RuntimeError: when no KV cache is bound (warmup has not run).
        """
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated: call Warmup first")
        return self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Attention from the QKV projection's output: per-head RMSNorm of q and k
        (``q_norm``/``k_norm``, both or neither), rotary, the cache write, attention.
        A backend that fuses the first three (:attr:`AttentionBackend.fuses_rope_write`)
        runs them as one kernel.

        Args:
            qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; may be
                overwritten (a fused backend rotates its keys in place for a prefill).
            cos, sin: [num_tokens, 1, head_dim] of the tokens' positions.

        Returns:
            [num_tokens, num_heads, head_dim].

        Raises:
            RuntimeError: when no KV cache is bound (warmup has not run).
        """
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated: call Warmup first")
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.backend.fuses_rope_write:
            norms = None
            if q_norm is not None and k_norm is not None:
                norms = (q_norm.weight, k_norm.weight)
            eps = q_norm.eps if q_norm is not None else 0.0
            q = self.backend.rope_write(qkv, self.num_heads, cos, sin, self.kv_cache,
                                        metadata, norms, eps)
            # k and v are views of qkv: whatever rope_write rotated there, they see
            return self.backend.attend(q, self.kv_cache, metadata, self.scale, (k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)  # over head_dim, each head alone
        q, k = apply_rotary(q, k, cos, sin)
        return self(q, k, v, metadata)
