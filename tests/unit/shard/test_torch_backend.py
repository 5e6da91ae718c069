"""The torch attention backend against a naive per-sequence reference over random
paged inputs with permuted blocks (prefill, prefill over a cached prefix, decode)."""

from __future__ import annotations

import math

import pytest
import torch

from shard.attention import AttentionSpec, get_backend_class, select_backend
from shard.attention.torch_backend import TorchAttentionBackend
from shard.inputs import SeqChunk, build_inputs
from shard.kv_cache import KVCacheLayer

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 64


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of k/v [seq_len, HKV, D]; causal."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("by_sequence", [True, False], ids=["by_sequence", "batched"])
@pytest.mark.parametrize("layout", ["permuted", "consecutive", "mixed"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "is_prefill"),
    [
        ([5, 1, 17, 9], [5, 1, 17, 9], True),  # plain varlen prefill
        ([12, 30, 7], [3, 30, 1], True),  # prefill over cached prefixes
        ([1, 13, 40, 8], [1, 1, 1, 1], False),  # decode
        ([1], [1], False),  # decode of a lone sequence
    ],
)
def test_matches_naive(
    seq_lens: list[int],
    q_lens: list[int],
    is_prefill: bool,
    layout: str,
    by_sequence: bool,
    head_major: bool,
) -> None:
    """Both code paths (by sequence: the CPU default; batched: elsewhere), over caches of
    both memory layouts, with block tables whose ids are permuted, consecutive (read in
    place by the by-sequence path), or consecutive for every other sequence only."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCacheLayer.zeros(NUM_BLOCKS, BS, HKV, D, head_major=head_major)
    assert cache.head_major == head_major
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    ordered = list(range(NUM_BLOCKS))
    chunks, full_k, full_v = [], [], []
    for i, (s, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        n = -(-s // BS)
        if layout == "consecutive" or (layout == "mixed" and i % 2 == 0):
            blocks, ordered = ordered[:n], ordered[n:]
            perm = [b for b in perm if b not in blocks]
        else:
            blocks, perm = perm[:n], perm[n:]
            ordered = [b for b in ordered if b not in blocks]
        k = torch.randn(s, HKV, D, generator=gen)
        v = torch.randn(s, HKV, D, generator=gen)
        # prefix already in the cache
        prefix = (
            build_inputs([SeqChunk([0] * (s - ql), 0, blocks)], BS, True, torch.device("cpu"))
            if s > ql
            else None
        )
        if prefix is not None:
            cache.write(k[: s - ql], v[: s - ql], prefix.metadata.slot_mapping, False)
        chunks.append(SeqChunk([0] * ql, s - ql, blocks))
        full_k.append(k)
        full_v.append(v)
    inputs = build_inputs(chunks, BS, is_prefill, torch.device("cpu"))
    q = torch.randn(inputs.metadata.num_tokens, H, D, generator=gen)
    new_k = torch.cat([k[-ql:] for k, ql in zip(full_k, q_lens, strict=True)])
    new_v = torch.cat([v[-ql:] for v, ql in zip(full_v, q_lens, strict=True)])
    scale = 1 / math.sqrt(D)
    backend = TorchAttentionBackend(by_sequence=by_sequence)
    backend.prepare(inputs.metadata)
    out = backend.forward(q, new_k, new_v, cache, inputs.metadata, scale)
    cu = inputs.metadata.cu_seqlens_q.tolist()
    for i in range(len(seq_lens)):
        ref = naive_attention(q[cu[i] : cu[i + 1]], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_kv_written_by_slot_mapping_and_negative_slots_skipped() -> None:
    cache = KVCacheLayer(torch.zeros(4, 2, 1, 1), torch.zeros(4, 2, 1, 1))
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    cache.write(k, -k, torch.tensor([5, -1, 0]), True)
    assert cache.key.flatten().tolist() == [3.0, 0, 0, 0, 0, 1.0, 0, 0]
    assert cache.value.flatten().tolist() == [-3.0, 0, 0, 0, 0, -1.0, 0, 0]


def test_head_major_cache_holds_the_same_tokens_per_head() -> None:
    """A head-major cache is written and read by slot like a token-major one, and each
    KV head's slots lie together in its storage (what the CPU attention reads)."""
    gen = torch.Generator().manual_seed(2)
    caches = [KVCacheLayer.zeros(NUM_BLOCKS, BS, HKV, D, head_major=hm) for hm in (False, True)]
    k, v = torch.randn(10, HKV, D, generator=gen), torch.randn(10, HKV, D, generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BS, generator=gen)[:10]
    for cache in caches:
        cache.write(k, v, slots, False)
    token_major, head_major = caches
    assert token_major.key.is_contiguous() and not token_major.head_major
    assert head_major.key.permute(2, 0, 1, 3).is_contiguous() and head_major.head_major
    assert torch.equal(token_major.key, head_major.key)
    assert torch.equal(token_major.value, head_major.value)
    assert KVCacheLayer.zeros(1, BS, HKV, D, head_major=True).head_major
    keys, values = head_major.heads_view()
    assert keys.is_contiguous() and values.is_contiguous()
    assert torch.equal(keys[:, slots], k.transpose(0, 1))
    assert torch.equal(values[:, slots], v.transpose(0, 1))


def test_head_major_only_where_the_by_sequence_path_reads_it() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert TorchAttentionBackend().kv_head_major(cpu)
    assert not TorchAttentionBackend().kv_head_major(cuda)
    assert not TorchAttentionBackend(by_sequence=False).kv_head_major(cpu)
    assert TorchAttentionBackend(by_sequence=True).kv_head_major(cuda)


def test_slot_mapping_and_metadata_layout() -> None:
    chunks = [SeqChunk([7, 8, 9], 2, [3, 1, 4]), SeqChunk([5], 0, [2], write_from=1)]
    inputs = build_inputs(chunks, 2, True, torch.device("cpu"))
    md = inputs.metadata
    assert md.slot_mapping.tolist() == [1 * 2 + 0, 1 * 2 + 1, 4 * 2 + 0, -1]
    assert inputs.positions.tolist() == [2, 3, 4, 0]
    assert md.cu_seqlens_q.tolist() == [0, 3, 4] and md.cu_seqlens_q.dtype == torch.int32
    assert md.cu_seqlens_k.tolist() == [0, 5, 6]
    assert md.seq_lens.tolist() == [5, 1]
    assert md.block_tables.tolist() == [[3, 1, 4], [2, 0, 0]]
    assert (md.max_seqlen_q, md.max_seqlen_k) == (3, 5)
    assert inputs.last_token_indices.tolist() == [2, 3]
    assert md.has_skipped_slots
    assert not build_inputs(chunks[:1], 2, True, torch.device("cpu")).metadata.has_skipped_slots


def test_registry() -> None:
    spec = AttentionSpec(torch.device("cpu"), torch.float32, 4, 2, 16, 16)
    backend, reason = select_backend("auto", spec)
    assert backend.name == "torch" and "auto chose torch" in reason
    assert get_backend_class("torch") is TorchAttentionBackend
    valid = "auto, triton, flash_attn, flashinfer, torch"
    with pytest.raises(ValueError, match=rf"unknown attention backend 'flash'; valid: {valid}"):
        select_backend("flash", spec)
    with pytest.raises(ValueError, match="not a multiple"):
        select_backend("torch", AttentionSpec(torch.device("cpu"), torch.float32, 4, 3, 16, 16))


def test_metadata_reused_with_a_cache_of_another_dtype_or_layout() -> None:
    """What a step derives in prepare (contexts, gather buffers) must not leak between
    caches of different dtypes or layouts, as when a test runs a float32 reference
    first."""
    gen = torch.Generator().manual_seed(1)
    seq_lens, tables = [9, 14], [[5, 2, 7], [3, 1, 6, 0]]
    inputs = build_inputs(
        [SeqChunk([0], n - 1, t) for n, t in zip(seq_lens, tables, strict=True)],
        BS,
        False,
        torch.device("cpu"),
    )
    key = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    value = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    q = torch.randn(2, H, D, generator=gen)
    k_new, v_new = torch.randn(2, HKV, D, generator=gen), torch.randn(2, HKV, D, generator=gen)
    backend = TorchAttentionBackend(by_sequence=True)
    backend.prepare(inputs.metadata)
    outs = []
    for dtype, head_major in [(torch.float32, False), (torch.float32, True),
                              (torch.bfloat16, False), (torch.bfloat16, True)]:
        cache = KVCacheLayer.zeros(NUM_BLOCKS, BS, HKV, D, dtype, head_major=head_major)
        cache.key.copy_(key)
        cache.value.copy_(value)
        outs.append(
            backend.forward(
                q.to(dtype), k_new.to(dtype), v_new.to(dtype), cache, inputs.metadata, 0.3
            ).float()
        )
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    for out in outs[2:]:
        torch.testing.assert_close(out, outs[0], atol=3e-2, rtol=3e-2)


def test_kv_writer_fallback_skips_slots_flagged_by_the_metadata() -> None:
    """The GPU backends' writer without Triton: the PyTorch write, told by the metadata
    whether slots are skipped."""
    from shard.attention.kv_write import KVWriter

    chunks = [SeqChunk([7, 8], 0, [1], write_from=1), SeqChunk([9], 0, [0])]
    metadata = build_inputs(chunks, 2, True, torch.device("cpu")).metadata
    assert metadata.slot_mapping.tolist() == [-1, 3, 0] and metadata.has_skipped_slots
    cache = KVCacheLayer(torch.zeros(2, 2, 1, 1), torch.zeros(2, 2, 1, 1))
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    KVWriter(use_triton=False)(cache, k, -k, metadata)
    assert cache.key.flatten().tolist() == [3.0, 0, 0, 2.0]
    assert cache.value.flatten().tolist() == [-3.0, 0, 0, -2.0]


@pytest.mark.parametrize("by_sequence", [True, False], ids=["by_sequence", "batched"])
def test_each_step_is_prepared_before_its_forward(by_sequence: bool) -> None:
    """prepare replaces the previous step's state: one backend over two decode steps of
    different layouts gives each step's own attention; a forward whose metadata was not
    prepared is refused instead of reading the previous step's contexts."""
    gen = torch.Generator().manual_seed(3)
    cache = KVCacheLayer(
        torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen),
        torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen),
    )
    backend = TorchAttentionBackend(by_sequence=by_sequence)
    steps = [([9, 14], [[5, 2, 7], [3, 1, 6, 0]]), ([6, 3, 11], [[8, 9], [4], [10, 11, 12]])]
    for seq_lens, tables in steps:
        metadata = build_inputs(
            [SeqChunk([0], n - 1, t) for n, t in zip(seq_lens, tables, strict=True)],
            BS,
            False,
            torch.device("cpu"),
        ).metadata
        q = torch.randn(len(seq_lens), H, D, generator=gen)
        k_new, v_new = (torch.randn(len(seq_lens), HKV, D, generator=gen) for _ in range(2))
        with pytest.raises(AssertionError, match=r"prepare\(metadata\) must run before"):
            backend.forward(q, k_new, v_new, cache, metadata, 0.3)
        backend.prepare(metadata)
        out = backend.forward(q, k_new, v_new, cache, metadata, 0.3)
        for i, (n, table) in enumerate(zip(seq_lens, tables, strict=True)):
            slots = [table[p // BS] * BS + p % BS for p in range(n)]
            keys = cache.key.view(-1, HKV, D)[slots]
            values = cache.value.view(-1, HKV, D)[slots]
            ref = naive_attention(q[i : i + 1], keys, values, 0.3)
            torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)
