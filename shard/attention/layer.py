"""The attention module a model layer calls: holds the backend and this layer's KV
cache, which the model runner binds after allocating the cache."""

from __future__ import annotations

import torch
from torch import nn

from shard.attention.base import AttentionBackend
from shard.attention.metadata import AttentionMetadata
from shard.kv_cache import KVCacheLayer


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
