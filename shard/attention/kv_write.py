"""Writing new K/V into the paged cache, shared by the GPU backends: our Triton
slot-mapping kernel where Triton imports, otherwise the PyTorch path of
:meth:`shard.kv_cache.KVCacheLayer.write`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer

_WriteFn = Callable[..., None]


def _triton_writer() -> _WriteFn | None:
    try:
        from shard.kernels.attention.cache_write import write_kv_cache
    except ImportError:
        return None
    return write_kv_cache


class KVWriter:
    """Writes k/v at ``slot_mapping`` (slots < 0 skipped), choosing the path once.

    Args:
        kernels: the runner's kernel choices (PDL of the Triton kernel); none: without
            PDL.
        use_triton: try the Triton kernel (falls back to PyTorch when it is missing).
    """

    def __init__(self, kernels: KernelChoices | None = None, use_triton: bool = True) -> None:
        self.kernels = kernels if kernels is not None else KernelChoices()
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
            self._triton(k, v, kv_cache.key, kv_cache.value, metadata.slot_mapping,
                         pdl=self.kernels.pdl)
        else:
            kv_cache.write(k, v, metadata.slot_mapping, metadata.has_skipped_slots)
