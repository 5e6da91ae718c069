"""flash-attn (>= 2.5) paged backend: ``flash_attn_varlen_func`` with a block table for
prefill (a cached prefix included) and ``flash_attn_with_kvcache`` for decode
(FlashAttention-2, Dao 2023). Optional extra: ``pip install shardserve[flash-attn]``.

Its paged API needs a KV block size that is a multiple of 256, which this backend
declares through :attr:`block_size_multiple`; the shard then reports that block size.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from shard.attention.base import FP8_KV_REFUSAL, AttentionBackend, AttentionSpec
from shard.attention.kv_write import KVWriter
from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer

MIN_VERSION = (2, 5)


def import_flash_attn() -> tuple[ModuleType | None, str]:
    """(flash_attn module or None, reason)."""
    try:
        import flash_attn as module
    except ImportError as exc:
        return None, f"flash_attn is not importable ({exc})"
    version = getattr(module, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        return None, f"flash_attn {version} < 2.5 (no paged KV API)"
    return module, f"flash_attn {version}"


class FlashAttnBackend(AttentionBackend):
    """flash-attn's paged kernels; K/V written by our slot-mapping kernel first."""

    name = "flash_attn"
    block_size_multiple: ClassVar[int] = 256
    # NOTE: the KV write is our Triton kernel (masked in-kernel, no host sync) wherever
    # flash-attn runs, since CUDA PyTorch ships Triton.
    cuda_graph_safe: ClassVar[bool] = True

    def __init__(self, kernels: KernelChoices | None = None) -> None:
        super().__init__(kernels)
        module, reason = import_flash_attn()
        assert module is not None, reason
        self._fa: Any = module
        self._write = KVWriter(self.kernels)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        if spec.fp8_kv_cache:
            return False, FP8_KV_REFUSAL
        module, reason = import_flash_attn()
        if module is None:
            return False, reason
        if spec.device.type != "cuda":
            return False, f"needs a CUDA device, got {spec.device.type}"
        major, minor = torch.cuda.get_device_capability(spec.device)
        if major < 8:
            return False, f"needs sm80+, device is sm{major}{minor}"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return False, f"dtype {spec.dtype} is not float16/bfloat16"
        if spec.head_dim % 8 != 0 or spec.head_dim > 256:
            return False, f"head_dim={spec.head_dim} is not a multiple of 8 up to 256"
        return True, f"{reason} paged API, block size a multiple of {cls.block_size_multiple}"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to derive: flash-attn and the KV write read the metadata's tensors
        themselves (so a captured decode graph replays over new inputs)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._write(kv_cache, k, v, metadata)
        if metadata.is_prefill:
            out: torch.Tensor = self._fa.flash_attn_varlen_func(
                q,
                kv_cache.key,
                kv_cache.value,
                metadata.cu_seqlens_q,
                metadata.cu_seqlens_k,
                metadata.max_seqlen_q,
                metadata.max_seqlen_k,
                softmax_scale=scale,
                causal=True,
                block_table=metadata.block_tables,
            )
            return out
        # q: [batch, 1, num_heads, head_dim]; the new token is already in the cache.
        out = self._fa.flash_attn_with_kvcache(
            q.unsqueeze(1),
            kv_cache.key,
            kv_cache.value,
            cache_seqlens=metadata.seq_lens,
            block_table=metadata.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
