"""Writing new K/V into the paged cache, shared by the GPU backends: our Triton
slot-mapping kernel where Triton imports, otherwise the PyTorch path of
:meth:`shard.kv_cache.KVCacheLayer.write`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from shard.attention.metadata import AttentionMetadata
from shard.kv_cache import KVCacheLayer

_WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _triton_writer() -> _WriteFn | None:
    try:
        module = importlib.import_module("shard.attention.triton_kernels.cache_write")
    except ImportError:
        return None
    fn: _WriteFn = module.write_kv_cache
    return fn


class KVWriter:
    """Writes k/v at ``slot_mapping`` (slots < 0 skipped), choosing the path once.

    Args:
        use_triton: try the Triton kernel (falls back to PyTorch when it is missing).
    """

    def __init__(self, use_triton: bool = True) -> None:
        self._triton = _triton_writer() if use_triton else None

    def __call__(
        self,
        kv_cache: KVCacheLayer,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim], written at ``metadata.slot_mapping``."""
        if self._triton is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
            self._triton(k, v, kv_cache.key, kv_cache.value, metadata.slot_mapping)
        else:
            kv_cache.write(k, v, metadata.slot_mapping, metadata.has_skipped_slots)
