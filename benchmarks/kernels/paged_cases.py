"""Random paged attention problems for the kernel benchmarks and the kernel tests (CPU
interpreter and GPU): ragged lengths, randomly permuted block tables, partly filled last
blocks, a cached prefix already in the cache and new tokens still to be written, and the
``torch`` backend's answer as the oracle. Here, not in tests/, so that the imports go one
way: tests import benchmarks, benchmarks never import tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shard.attention.base import AttentionBackend
from shard.attention.metadata import AttentionMetadata
from shard.attention.torch_backend import TorchAttentionBackend
from shard.inputs import SeqChunk, build_inputs
from shard.kv_cache import KVCacheLayer


@dataclass(frozen=True)
class PagedCase:
    """One forward's inputs.

    Attributes:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
            new keys/values, not yet in the cache.
        cache: KV cache holding every sequence's cached prefix (other slots random).
        metadata: the batch layout (block tables permuted at random).
        scale: softmax scale.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: KVCacheLayer
    metadata: AttentionMetadata
    scale: float

    def fresh_cache(self) -> KVCacheLayer:
        """A copy of the cache, so each backend writes into its own."""
        return KVCacheLayer(self.cache.key.clone(), self.cache.value.clone())


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    consecutive: bool = False,
) -> PagedCase:
    """Build a case: sequence ``i`` has ``seq_lens[i]`` context tokens, the last
    ``q_lens[i]`` of them new. Decode when every q_len is 1 and ``seq_lens`` > 1 is
    not required (``is_prefill`` is False iff all q_lens are 1). Block tables are a
    random permutation of the cache's blocks, or with ``consecutive`` each sequence's
    blocks are consecutive ids, one sequence after another (as the router's allocator
    lays out tables that grow side by side)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    # NOTE: the cache is drawn on the device itself: a GPU benchmark's cache is GBs
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = (list(range(num_blocks)) if consecutive
            else torch.randperm(num_blocks, generator=gen).tolist())
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    value = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    cache = KVCacheLayer(key, value)
    chunks = []
    for s, ql, nb in zip(seq_lens, q_lens, blocks_per_seq, strict=True):
        blocks, perm = perm[:nb], perm[nb:]
        chunks.append(SeqChunk([0] * ql, s - ql, blocks))
    is_prefill = any(ql != 1 for ql in q_lens)
    metadata = build_inputs(chunks, block_size, is_prefill, device).metadata
    t = metadata.num_tokens

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(dtype).to(device)

    return PagedCase(
        q=rand(t, num_heads, head_dim),
        k=rand(t, num_kv_heads, head_dim),
        v=rand(t, num_kv_heads, head_dim),
        cache=cache,
        metadata=metadata,
        scale=1 / math.sqrt(head_dim),
    )


def run_backend(
    backend: AttentionBackend,
    case: PagedCase,
    cache: KVCacheLayer,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One step of ``backend`` over ``case`` (its ``prepare``, then one layer's forward)
    writing into ``cache``, with q/k/v cast to ``dtype`` when given.

    Returns:
        [num_tokens, num_heads, head_dim].
    """
    q, k, v = (t if dtype is None else t.to(dtype) for t in (case.q, case.k, case.v))
    backend.prepare(case.metadata)
    return backend.forward(q, k, v, cache, case.metadata, case.scale)


def reference(case: PagedCase) -> tuple[torch.Tensor, KVCacheLayer]:
    """The ``torch`` backend in float32 on the case's device: (out [num_tokens,
    num_heads, head_dim] float32, the cache after the write, float32)."""
    cache = KVCacheLayer(case.cache.key.float(), case.cache.value.float())
    return run_backend(TorchAttentionBackend(), case, cache, torch.float32), cache


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN if out has any NaN)."""
    out64, ref64 = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64))
