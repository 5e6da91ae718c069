"""Paged KV cache storage.

Per layer two tensors (key and value) of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``j`` of a request with
block table ``bt`` lives at slot ``bt[j // block_size] * block_size + j % block_size``.
The router decides which blocks a request gets; the shard only reads and writes them.

Two memory layouts carry that shape. Token-major (the default, contiguous; what the GPU
kernels take): the KV heads of one slot lie together. Head-major (``head_major=True``):
the tensors are views of ``[num_kv_heads, num_blocks, block_size, head_dim]`` storage,
so each KV head's slots lie together and a run of consecutive blocks is one contiguous
``[seq_len, head_dim]`` stretch per head, the layout the CPU attention kernel reads
fastest (see :meth:`TorchAttentionBackend.kv_head_major`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayer:
    """One layer's cache.

    Attributes:
        key: [num_blocks, block_size, num_kv_heads, head_dim], model dtype; token-major
            (contiguous) or a head-major view (see the module docstring).
        value: like ``key``, same layout.
    """

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def zeros(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        head_major: bool = False,
    ) -> KVCacheLayer:
        """A zero-filled layer, token-major or ``head_major`` (see the module docstring)."""

        def tensor() -> torch.Tensor:
            if head_major:
                storage = torch.zeros(
                    (num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device
                )
                return storage.permute(1, 2, 0, 3)
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(tensor(), tensor())

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def head_major(self) -> bool:
        """Whether each KV head's slots lie together (see the module docstring): token-major
        caches are contiguous, head-major ones are not (but with one KV head, where both
        layouts are the same memory order)."""
        return not self.key.is_contiguous()

    def heads_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value as [num_kv_heads, num_blocks * block_size, head_dim] views, by
        slot: contiguous when :attr:`head_major`, strided otherwise."""
        return self.slots(self.key).transpose(0, 1), self.slots(self.value).transpose(0, 1)

    @staticmethod
    def slots(cache: torch.Tensor) -> torch.Tensor:
        """``cache`` (``key`` or ``value``) as a [num_blocks * block_size, num_kv_heads,
        head_dim] view, by slot, in either layout (never a copy)."""
        return cache.view(-1, *cache.shape[2:])

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
        key, value = self.slots(self.key), self.slots(self.value)
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
    head_major: bool = False,
) -> list[KVCacheLayer]:
    """Allocate one :class:`KVCacheLayer` per layer, zero-filled, token-major or
    ``head_major`` (see the module docstring).

    NOTE: zeros, not ``torch.empty``: padded block-table entries point at real blocks
    whose values are masked out, and ``0 * NaN`` from uninitialised memory would
    still poison the attention output.
    """
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    return [
        KVCacheLayer.zeros(num_blocks, block_size, kv_heads, model.head_dim, dtype, device,
                           head_major)
        for _ in range(model.num_hidden_layers)
    ]
