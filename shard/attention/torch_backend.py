"""Pure-PyTorch attention over a paged KV cache: the reference every other backend is
tested against. Runs on CPU and GPU, with two paths, chosen per step.

Batched (the default off CPU; :mod:`shard.attention.torch_batched`): prefill over padded
views with an explicit causal mask, decode over the blocks each sequence uses with
per-block softmax partials.

By sequence (the default on CPU; :mod:`shard.attention.torch_by_sequence`): one SDPA
call per sequence over exactly its context, read in place where its blocks are
consecutive.

Here: the backend, which writes the new keys/values to the cache and sends each step
down one path. An fp8 cache (:mod:`shard.kv_cache`) is read dequantized by both paths,
and a prefill's new tokens are attended as the cache holds them
(:meth:`KVCacheLayer.read_back`), as our Triton kernels read them from the cache.
"""

from __future__ import annotations

import torch

from shard.attention.base import AttentionBackend, AttentionSpec
from shard.attention.metadata import AttentionMetadata
from shard.attention.torch_batched import (
    gather_kv,
    padded_prefill_attention,
    paged_decode_attention,
    single_decode_attention,
)
from shard.attention.torch_by_sequence import (
    SequenceContexts,
    decode_attention_by_sequence,
    prefill_attention_by_sequence,
)
from shard.kernels.choices import KernelChoices
from shard.kv_cache import KVCacheLayer


class TorchAttentionBackend(AttentionBackend):
    """Reference backend (SDPA with an explicit mask; GQA through ``enable_gqa``)."""

    name = "torch"
    block_size_multiple = 1

    def __init__(
        self, by_sequence: bool | None = None, kernels: KernelChoices | None = None
    ) -> None:
        """``by_sequence``: attend one sequence at a time over exactly its context
        (:func:`prefill_attention_by_sequence`, :func:`decode_attention_by_sequence`)
        instead of batched over padded or block-split contexts. None (default) chooses
        per step: by sequence on CPU, batched elsewhere (one kernel for the batch).
        ``kernels``: unused (no kernel of ours runs here)."""
        super().__init__(kernels)
        self.by_sequence = by_sequence
        # this step's metadata and, on the by-sequence path, its contexts (see prepare)
        self._metadata: AttentionMetadata | None = None
        self._contexts: SequenceContexts | None = None

    def _by_sequence(self, device: torch.device) -> bool:
        return device.type == "cpu" if self.by_sequence is None else self.by_sequence

    def kv_head_major(self, device: torch.device) -> bool:
        """Head-major on the by-sequence path: each sequence's keys and values are then
        one contiguous stretch per KV head where its blocks are consecutive (and in the
        gathered buffer where not), which the CPU's SDPA kernel reads faster than rows
        of interleaved heads (SmolLM2-135M's 3 KV heads of 64, one EPYC core: 77
        against 109 µs per call over 300 tokens, 146 against 254 over 700; 2026-12-03)."""
        return self._by_sequence(device)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> tuple[bool, str]:
        return True, "pure PyTorch reference backend: runs on any device and dtype"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """On the by-sequence path: place every sequence's context in the cache once for
        the step (:class:`SequenceContexts`; it reads the block tables on the host)."""
        self._metadata = metadata
        by_sequence = self._by_sequence(metadata.seq_lens.device)
        self._contexts = SequenceContexts(metadata) if by_sequence else None

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
        kv_cache.write(k, v, metadata.slot_mapping, metadata.has_skipped_slots)
        k, v = kv_cache.read_back(k, v)
        contexts = self._contexts
        if not metadata.is_prefill:
            if contexts is not None:
                return decode_attention_by_sequence(q, kv_cache, contexts, scale)
            if metadata.num_seqs == 1:  # nothing to pad: one gather, two matmuls
                keys, values = gather_kv(kv_cache, metadata.block_tables, metadata.max_seqlen_k)
                return single_decode_attention(q, keys, values, scale)
            return paged_decode_attention(
                q, kv_cache, metadata.block_tables, metadata.seq_lens, scale
            )
        if contexts is not None:
            return prefill_attention_by_sequence(q, k, v, kv_cache, metadata, contexts, scale)
        return padded_prefill_attention(q, kv_cache, metadata, scale)
