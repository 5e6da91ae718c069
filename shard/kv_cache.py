"""Paged KV cache storage.

Per layer two tensors (key and value) of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``j`` of a request with
block table ``bt`` lives at slot ``bt[j // block_size] * block_size + j % block_size``.
The router decides which blocks a request gets; the shard only reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayer:
    """One layer's cache.

    Attributes:
        key: [num_blocks, block_size, num_kv_heads, head_dim], model dtype.
        value: [num_blocks, block_size, num_kv_heads, head_dim], model dtype.
    """

    key: torch.Tensor
    value: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        has_skipped: bool,
    ) -> None:
        """Store new keys/values by slot.

        Args:
            k: [num_tokens, num_kv_heads, head_dim].
            v: [num_tokens, num_kv_heads, head_dim].
            slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset.
                Entries < 0 are skipped (tokens whose K/V are already cached).
            has_skipped: whether ``slot_mapping`` has entries < 0
                (:attr:`AttentionMetadata.has_skipped_slots`, known on the host, so the
                tensor is never inspected).
        """
        key = self.key.view(-1, *self.key.shape[2:])
        value = self.value.view(-1, *self.value.shape[2:])
        if has_skipped:
            keep = slot_mapping >= 0
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        key.index_copy_(0, slot_mapping, k.to(key.dtype))
        value.index_copy_(0, slot_mapping, v.to(value.dtype))


def bytes_per_block(
    model: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes one KV block takes over all layers, K and V, on one rank."""
    elem = torch.empty(0, dtype=dtype).element_size()
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    return 2 * model.num_hidden_layers * block_size * kv_heads * model.head_dim * elem


def allocate_kv_cache(
    model: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> list[KVCacheLayer]:
    """Allocate one :class:`KVCacheLayer` per layer, zero-filled.

    NOTE: zeros, not ``torch.empty``: padded block-table entries point at real blocks
    whose values are masked out, and ``0 * NaN`` from uninitialised memory would
    still poison the attention output.
    """
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    shape = (num_blocks, block_size, kv_heads, model.head_dim)
    return [
        KVCacheLayer(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(model.num_hidden_layers)
    ]
