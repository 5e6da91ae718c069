"""Our Triton backend: paged split-KV decode, paged varlen prefill and the
slot-mapping cache write (see :mod:`shard.kernels.attention`). Any CUDA GPU with
Triton; any block size."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import ClassVar

import torch

from shard.attention.base import AttentionBackend, AttentionSpec
from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def import_triton() -> tuple[ModuleType | None, str]:
    """(triton module or None, reason). Any import failure counts as "unavailable"."""
    try:
        import triton
    except ImportError as exc:
        return None, f"triton is not importable ({exc})"
    return triton, "ok"


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through our Triton kernels.

    Prefill: :func:`~shard.kernels.attention.prefill_attention`; decode:
    :func:`~shard.kernels.attention.decode_attention`; both read every key from
    the paged cache after the new tokens are written by slot mapping, except a prefill
    with no cached prefix that comes through :meth:`rope_write`: it reads the rotated
    keys and the values from the QKV output itself (15–19% faster on the H200 than
    through the block tables, ``benchmarks/results/kernels-h200.md``; the same bits).
    An fp8 cache (:mod:`shard.kv_cache`) is written quantized and read dequantized in
    registers by every kernel; its prefills always read the cache.
    """

    name = "triton"
    block_size_multiple: ClassVar[int] = 1
    cuda_graph_safe: ClassVar[bool] = True
    fuses_rope_write: ClassVar[bool] = True

    def __init__(self, kernels: KernelChoices | None = None) -> None:
        super().__init__(kernels)
        # NOTE: imported here, not at module import, so the registry imports without
        # Triton and TRITON_INTERPRET is read only when a backend is built.
        from shard.kernels import attention

        self._attention = attention
        # the step :meth:`prepare` last split (a mixed step), with its two parts
        self._mixed: tuple[AttentionMetadata, AttentionMetadata, AttentionMetadata] | None \
            = None

    @classmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        triton, reason = import_triton()
        if triton is None:
            return False, reason
        if spec.device.type != "cuda":
            return False, f"needs a CUDA device, got {spec.device.type}"
        if spec.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {spec.dtype} not in {SUPPORTED_DTYPES}"
        if spec.head_dim > MAX_HEAD_DIM:
            return False, f"head_dim={spec.head_dim} > {MAX_HEAD_DIM}"
        if spec.fp8_kv_cache and torch.cuda.get_device_capability(spec.device) < (8, 9):
            return False, "an fp8 KV cache needs compute capability 8.9+ (e4m3 conversions)"
        return True, f"our Triton paged kernels (triton {triton.__version__})"

    def eager_decode_contexts(self, num_kv_heads: int, max_context: int) -> list[int]:
        """One context per decode kernel variant (:func:`~shard.kernels.attention.decode.
        split_classes`)."""
        return self._attention.split_classes(num_kv_heads, max_context)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """A decode or prefill step: nothing to derive, the kernels read the metadata's
        tensors themselves (so a captured decode graph replays over new inputs). A mixed
        step: its two parts (:meth:`_split_mixed`), once for every layer."""
        self._mixed = (metadata, *self._split_mixed(metadata)) \
            if metadata.is_prefill and metadata.decode_rows else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._attention.write_kv_cache(k, v, kv_cache.key, kv_cache.value,
                                       metadata.slot_mapping, kv_cache.key_scale,
                                       kv_cache.value_scale, pdl=self.kernels.pdl)
        return self.attend(q, kv_cache, metadata, scale)

    def rope_write(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
        eps: float,
    ) -> torch.Tensor:
        q_weight, k_weight = norm_weights if norm_weights is not None else (None, None)
        q: torch.Tensor = self._attention.rope_write(
            qkv, num_heads, kv_cache.key.shape[2], cos, sin, kv_cache.key, kv_cache.value,
            metadata.slot_mapping, q_weight, k_weight, eps,
            k_in_place=self._reads_new_kv(metadata, kv_cache, qkv),
            key_scale=kv_cache.key_scale, value_scale=kv_cache.value_scale,
            pdl=self.kernels.pdl,
        )
        return q

    @staticmethod
    def _reads_new_kv(metadata: AttentionMetadata, kv_cache: KVCacheLayer,
                      qkv: torch.Tensor) -> bool:
        """Whether this step's attention reads the new K/V from the QKV output (``qkv``,
        or a view of it): a prefill with no cached prefix, whose cache holds what
        ``qkv`` holds (same dtype)."""
        return (metadata.is_prefill and not metadata.has_cached_prefix
                and qkv.dtype == kv_cache.key.dtype)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kern = self._attention
        q = q if q.stride(-1) == 1 else q.contiguous()
        if metadata.is_prefill and metadata.decode_rows:
            return self._attend_mixed(q, kv_cache, metadata, scale)
        if metadata.is_prefill:
            if new_kv is not None and not self._reads_new_kv(metadata, kv_cache, new_kv[0]):
                new_kv = None  # rope_write left the keys unrotated there: the cache
            out: torch.Tensor = kern.prefill_attention(
                q,
                kv_cache.key,
                kv_cache.value,
                metadata.block_tables,
                metadata.cu_seqlens_q,
                metadata.seq_lens,
                metadata.max_seqlen_q,
                scale,
                new_kv=new_kv,
                key_scale=kv_cache.key_scale,
                value_scale=kv_cache.value_scale,
                pdl=self.kernels.pdl,
            )
            return out
        out = kern.decode_attention(
            q,
            kv_cache.key,
            kv_cache.value,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.max_seqlen_k,
            scale,
            key_scale=kv_cache.key_scale,
            value_scale=kv_cache.value_scale,
            pdl=self.kernels.pdl,
        )
        return out

    def _attend_mixed(self, q: torch.Tensor, kv_cache: KVCacheLayer,
                      metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """A mixed step: the prompt chunks through the prefill kernel, the decoding rows
        (the last ``decode_rows`` sequences, one token each) through the decode kernel,
        which reads each row's context once per KV head instead of in a query tile of
        mostly padding."""
        mixed = self._mixed
        prompts, decoding = (mixed[1:] if mixed is not None and mixed[0] is metadata
                             else self._split_mixed(metadata))
        tokens = q.shape[0] - metadata.decode_rows
        return torch.cat([self.attend(q[:tokens], kv_cache, prompts, scale),
                          self.attend(q[tokens:], kv_cache, decoding, scale)])

    @staticmethod
    def _split_mixed(metadata: AttentionMetadata
                     ) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step's prompt chunks and decoding rows as a prefill step and a decode
        step. The rows' block tables and lengths are copies, not views into the step's:
        a view starts wherever the prompts end, often off a 16-byte boundary, and Triton
        compiles another variant of the decode kernel for an unaligned pointer, in the
        middle of serving (tests/kernels/test_warmup_variants.py)."""
        rows, seqs = metadata.decode_rows, metadata.num_seqs
        prompts = dataclasses.replace(
            metadata, block_tables=metadata.block_tables[: seqs - rows],
            cu_seqlens_q=metadata.cu_seqlens_q[: seqs - rows + 1],
            seq_lens=metadata.seq_lens[: seqs - rows], decode_rows=0)
        decoding = dataclasses.replace(
            metadata, is_prefill=False,
            block_tables=metadata.block_tables[seqs - rows:].clone(),
            seq_lens=metadata.seq_lens[seqs - rows:].clone(),
            max_seqlen_k=metadata.decode_max_seqlen_k, decode_rows=0)
        return prompts, decoding
