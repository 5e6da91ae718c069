"""The attention backend interface. One backend is chosen at start-up (see
:func:`shard.attention.select_backend`) and shared by every layer."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer

# Why a backend without fp8 KV kernels of ours skips an fp8 cache.
FP8_KV_REFUSAL = ("its kernels do not read our fp8 KV cache (--kv-cache-dtype fp8: e4m3 with a "
                  "scale per token and head); the triton and torch backends do")


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend must support for a given model and shard.

    Attributes:
        device: where tensors live.
        dtype: activation and KV cache dtype.
        num_heads: query heads on this rank.
        num_kv_heads: key/value heads on this rank.
        head_dim: per-head dimension.
        block_size: tokens per KV block.
        kv_cache_dtype: the KV cache's dtype when it is not ``dtype``
            (float8_e4m3fn: ``--kv-cache-dtype fp8``, see :mod:`shard.kv_cache`).
    """

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_cache_dtype: torch.dtype | None = None

    @property
    def fp8_kv_cache(self) -> bool:
        """Whether the KV cache is fp8 (with scales)."""
        return self.kv_cache_dtype == torch.float8_e4m3fn


class AttentionBackend(abc.ABC):
    """Writes new K/V into the paged cache and attends over each sequence's context.

    Subclasses set :attr:`name`, :attr:`block_size_multiple` (the KV block size the
    backend needs is a multiple of it: flash-attn's paged API needs 256, ours any) and
    :attr:`cuda_graph_safe`, and implement :meth:`supports`, :meth:`prepare` and
    :meth:`forward`. ``supports`` is also where a backend
    checks that its optional package imports, so a missing package means "skipped".

    A forward step calls :meth:`prepare` once with the step's metadata, then every
    layer's :meth:`forward` with that same metadata.

    Args:
        kernels: the runner's kernel choices (whether our Triton kernels launch with
            programmatic dependent launch); none given: without.
    """

    name: ClassVar[str]
    block_size_multiple: ClassVar[int] = 1
    # Whether a decode step through this backend can be captured in a CUDA graph: no
    # host synchronisation, no host values that change from step to step.
    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, kernels: KernelChoices | None = None) -> None:
        self.kernels = kernels if kernels is not None else KernelChoices()

    @classmethod
    def kv_block_size(cls, requested: int) -> int:
        """The KV block size (tokens) this backend runs with when ``requested`` is
        configured: the smallest multiple of :attr:`block_size_multiple` that is
        >= ``requested``. The shard reports it in ``Info``/``Warmup`` and the router's
        block manager allocates blocks of that size."""
        m = cls.block_size_multiple
        return -(-requested // m) * m

    def kv_head_major(self, device: torch.device) -> bool:
        """Whether this backend reads a KV cache allocated head-major on ``device``
        faster (see :mod:`shard.kv_cache`); False: token-major, contiguous, the layout
        every GPU kernel here takes."""
        return False

    def eager_decode_contexts(self, num_kv_heads: int, max_context: int) -> list[int]:
        """Context lengths (tokens, at most ``max_context``) at which warm-up runs an
        eager decode step of one sequence, so that every kernel variant a decode outside
        the CUDA graphs can launch (a mixed step's decode rows) is compiled before
        serving; none for backends whose kernels are compiled ahead of time."""
        return []

    @classmethod
    @abc.abstractmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        """Whether this backend can run ``spec``; the reason when it cannot (or "ok")."""

    @abc.abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Derive what every layer of this step reuses (host-side plans, index tensors)
        from ``metadata``, replacing the previous step's; called once per forward step,
        before the model runs.

        In a decode step captured as a CUDA graph (backends with :attr:`cuda_graph_safe`)
        it runs inside the captured region and is replayed with it, so such a backend's
        ``prepare`` must be graph-safe as well: device work on the metadata's tensors
        only, no host reads of them.
        """

    # Whether :meth:`rope_write` and :meth:`attend` are implemented: the layer then
    # hands them the QKV projection's output (one kernel for q/k norms, rotary and the
    # cache write) instead of calling :meth:`forward`.
    fuses_rope_write: ClassVar[bool] = False

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
        """Rotate q and k of ``qkv`` (per-head RMSNorm first when ``norm_weights`` =
        (q weight, k weight) are given) and write k and v at ``metadata.slot_mapping``.

        Args:
            qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim].
            cos, sin: [num_tokens, 1, head_dim] rotary cos/sin of the tokens' positions.

        Returns:
            q: [num_tokens, num_heads, head_dim], for :meth:`attend`. A backend may also
            overwrite ``qkv``'s k heads with the rotated keys (ours does in a prefill
            without a cached prefix), so ``qkv`` is the layer's to give away.

        Raises:
            NotImplementedError: unless :attr:`fuses_rope_write`.
        """
        raise NotImplementedError(f"{self.name} does not fuse rotary with the cache write")

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` without the cache write (done by :meth:`rope_write`).
        ``new_kv``: views of the k and v heads of the tensor :meth:`rope_write` was just
        given with the same ``metadata`` (each [num_tokens, num_kv_heads, head_dim]),
        from which a backend may read the new tokens' K/V where it rotated the keys
        there (see :attr:`AttentionMetadata.has_cached_prefix`).

        Raises:
            NotImplementedError: unless :attr:`fuses_rope_write`.
        """
        raise NotImplementedError(f"{self.name} does not fuse rotary with the cache write")

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v at ``metadata.slot_mapping``, then attend. ``metadata`` is the one
        last passed to :meth:`prepare`.

        Args:
            q: [num_tokens, num_heads, head_dim].
            k: [num_tokens, num_kv_heads, head_dim].
            v: [num_tokens, num_kv_heads, head_dim].
            kv_cache: this layer's cache.
            metadata: batch layout (see :class:`AttentionMetadata`).
            scale: softmax scale, usually head_dim ** -0.5.

        Returns:
            [num_tokens, num_heads, head_dim], dtype of q. Each query attends causally to
            its sequence's context: token at absolute position p sees positions 0..p.
        """
