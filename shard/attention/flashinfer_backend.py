"""FlashInfer backend: its paged prefill and decode wrappers over our cache layout
(``NHD``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V).
Optional extra: ``pip install shardserve[flashinfer]``.

FlashInfer plans each batch on the host (page index arrays, split sizes); the plan
depends only on the step's metadata, so it is made once per forward step and reused by
every layer: :meth:`FlashInferBackend.prepare` builds the page indices and the step's
first layer plans (the plan also needs head counts, dtypes and the softmax scale, which
come with the layer's tensors). ``backend="fa2"`` is passed because other FlashInfer
backends download prebuilt kernels.
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

WORKSPACE_BYTES = 128 * 1024 * 1024
HEAD_DIMS = (64, 128, 256)


def import_flashinfer() -> tuple[ModuleType | None, str]:
    """(flashinfer module or None, reason)."""
    try:
        import flashinfer as module
    except ImportError as exc:
        return None, f"flashinfer is not importable ({exc})"
    return module, f"flashinfer {getattr(module, '__version__', '?')}"


def paged_kv_indices(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our block tables in FlashInfer's CSR form.

    Args:
        block_tables: [batch, max_blocks] int32.
        seq_lens: [batch] int32 context lengths in tokens.

    Returns:
        (indptr [batch + 1] int32, indices [total pages] int32, last_page_len [batch]
        int32 tokens in each sequence's last block, 1..block_size).
    """
    pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    indices = block_tables[cols[None, :] < pages[:, None]].to(torch.int32)
    last = ((seq_lens - 1) % block_size + 1).to(torch.int32)
    return indptr, indices, last


class FlashInferBackend(AttentionBackend):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal, bottom-right aligned,
    so a cached prefix works) and ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores
    when the group size is >= 4)."""

    name = "flashinfer"
    block_size_multiple: ClassVar[int] = 1

    def __init__(self, kernels: KernelChoices | None = None) -> None:
        super().__init__(kernels)
        module, reason = import_flashinfer()
        assert module is not None, reason
        self._fi: Any = module
        self._write = KVWriter(self.kernels)
        self._prefill: Any = None
        self._decode: Any = None
        # this step's metadata, its pages in FlashInfer's CSR form, and whether the
        # step's wrapper is planned yet (see prepare)
        self._metadata: AttentionMetadata | None = None
        self._pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._planned = False

    @classmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        if spec.fp8_kv_cache:
            return False, FP8_KV_REFUSAL
        module, reason = import_flashinfer()
        if module is None:
            return False, reason
        if spec.device.type != "cuda":
            return False, f"needs a CUDA device, got {spec.device.type}"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return False, f"dtype {spec.dtype} is not float16/bfloat16"
        if spec.head_dim not in HEAD_DIMS:
            return False, f"head_dim={spec.head_dim} not in {HEAD_DIMS}"
        return True, f"{reason} paged prefill/decode wrappers (fa2)"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """The step's pages in FlashInfer's form (:func:`paged_kv_indices`); the wrapper
        is planned again by the step's first layer."""
        self._metadata = metadata
        self._pages = paged_kv_indices(
            metadata.block_tables, metadata.seq_lens, metadata.block_size
        )
        self._planned = False

    def _plan(self, q: torch.Tensor, kv_cache: KVCacheLayer, md: AttentionMetadata, scale: float):
        """The wrapper for this step, planned by the step's first call."""
        if self._prefill is None:
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            group = q.shape[1] // kv_cache.key.shape[2]
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend="fa2"
            )
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=group >= 4, backend="fa2"
            )
        wrapper = self._prefill if md.is_prefill else self._decode
        if self._planned:
            return wrapper
        assert self._pages is not None
        indptr, indices, last = self._pages
        heads = (q.shape[1], kv_cache.key.shape[2], q.shape[2], kv_cache.block_size)
        if md.is_prefill:
            wrapper.plan(
                md.cu_seqlens_q, indptr, indices, last, *heads, causal=True, sm_scale=scale,
                q_data_type=q.dtype, kv_data_type=kv_cache.key.dtype,
            )
        else:
            wrapper.plan(
                indptr, indices, last, *heads, sm_scale=scale, q_data_type=q.dtype,
                kv_data_type=kv_cache.key.dtype,
            )
        self._planned = True
        return wrapper

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
        self._write(kv_cache, k, v, metadata)
        wrapper = self._plan(q, kv_cache, metadata, scale)
        out: torch.Tensor = wrapper.run(q.contiguous(), (kv_cache.key, kv_cache.value))
        return out
