"""The fp8 KV cache through our Triton kernels (CPU: Triton's interpreter) against the
``torch`` backend reading the same fp8 cache: the cache write, the fused rotary + cache
write, decode (one split and several) and prefill over a cached prefix.

Tolerances: the write kernels quantize as the torch path does (same scale, same
rounding): scales equal to float32 rounding (1e-6 relative) and at most one e4m3 step
apart in a few elements where a division lands on a rounding tie; attention over the
same fp8 cache agrees to float32 summation order (1e-5 relative, as the unquantized
kernel tests); against attention over the unquantized cache, e4m3's rounding (2^-4
relative per element) leaves a few percent."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.kernels.paged_cases import PagedCase, make_case, reference, rel_error, run_backend
from shard.attention.torch_backend import TorchAttentionBackend
from shard.attention.triton_backend import TritonAttentionBackend
from shard.kernels.attention import DecodeConfig, decode_attention, rope_write, write_kv_cache
from shard.kv_cache import KVCacheLayer
from shard.layers.fused import apply_rotary
from shard.layers.rotary import RotaryEmbedding
from shard.models.config import RopeConfig
from shard.quantization.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS = 2
TOL = 1e-5 if DEVICE == "cpu" else 1e-4
FP8_TOL = 0.05  # against the unquantized cache


def fp8_cache(cache: KVCacheLayer) -> KVCacheLayer:
    """``cache`` quantized as :meth:`KVCacheLayer.write` stores it."""
    (k, ks), (v, vs) = quantize_rows(cache.key), quantize_rows(cache.value)
    return KVCacheLayer(k, v, ks, vs)


def copy(cache: KVCacheLayer) -> KVCacheLayer:
    assert cache.key_scale is not None and cache.value_scale is not None
    return KVCacheLayer(cache.key.clone(), cache.value.clone(), cache.key_scale.clone(),
                        cache.value_scale.clone())


def assert_same_cache(got: KVCacheLayer, want: KVCacheLayer) -> None:
    """Scales equal to float32 rounding; values at most one e4m3 step apart."""
    assert got.key_scale is not None and want.key_scale is not None
    assert got.value_scale is not None and want.value_scale is not None
    torch.testing.assert_close(got.key_scale, want.key_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.value_scale, want.value_scale, rtol=1e-6, atol=0)
    for a, b in ((got.key, want.key), (got.value, want.value)):
        assert a.dtype == FP8_DTYPE
        step = b.float().abs() * 2**-3 + 2**-9  # one e4m3 step (normal or subnormal)
        assert ((a.float() - b.float()).abs() <= step).all()
        assert (a.float() != b.float()).float().mean() < 0.01


def _case(seq_lens: list[int], q_lens: list[int], group: int, seed: int) -> PagedCase:
    return make_case(seq_lens, q_lens, group * KV_HEADS, KV_HEADS, 64, device=DEVICE,
                     seed=seed)


def test_cache_write_quantizes_as_the_torch_write() -> None:
    case = _case([20, 40, 7], [20, 5, 1], 2, seed=1)
    cache = fp8_cache(case.cache)
    ours, ref = copy(cache), copy(cache)
    slots = case.metadata.slot_mapping.clone()
    slots[3] = -1  # a token whose K/V are already cached: not written
    write_kv_cache(case.k, case.v, ours.key, ours.value, slots, ours.key_scale,
                   ours.value_scale)
    ref.write(case.k, case.v, slots, has_skipped=True)
    assert_same_cache(ours, ref)
    written = slots[slots >= 0]
    back = dequantize_rows(ours.key.view(-1, KV_HEADS, 64)[written],
                           ours.key_scale.view(-1, KV_HEADS)[written])
    keep = torch.arange(len(slots)) != 3
    assert rel_error(back, case.k[keep]) < FP8_TOL


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("seq_lens", "q_lens"), [([1, 20, 16, 77], [1] * 4),
                                                  ([23, 100, 9, 41], [23, 30, 1, 40])],
                         ids=["decode", "prefill-over-prefix"])
def test_backend_reads_the_fp8_cache_as_the_torch_backend(
    group: int, seq_lens: list[int], q_lens: list[int]
) -> None:
    case = _case(seq_lens, q_lens, group, seed=group + len(q_lens))
    cache = fp8_cache(case.cache)
    ours, ref_cache = copy(cache), copy(cache)
    out = run_backend(TritonAttentionBackend(), case, ours)
    ref = run_backend(TorchAttentionBackend(), case, ref_cache)
    assert rel_error(out, ref) < TOL
    assert_same_cache(ours, ref_cache)
    exact, _ = reference(case)  # the unquantized cache
    assert 1e-4 < rel_error(out, exact) < FP8_TOL


@pytest.mark.parametrize(
    "config", [DecodeConfig(target_programs=1), DecodeConfig(block_n=16, target_programs=10**6)],
    ids=["one-split", "split-per-tile"])
def test_decode_splits_over_an_fp8_cache(config: DecodeConfig) -> None:
    case = make_case([5, 50, 33, 120], [1] * 4, 8, 2, 64, block_size=8, device=DEVICE, seed=3)
    cache = fp8_cache(case.cache)
    cache.write(case.k, case.v, case.metadata.slot_mapping, has_skipped=False)
    ref = run_backend(TorchAttentionBackend(), case, copy(cache))
    md = case.metadata
    out = decode_attention(case.q, cache.key, cache.value, md.block_tables, md.seq_lens,
                           md.max_seqlen_k, case.scale, config=config,
                           key_scale=cache.key_scale, value_scale=cache.value_scale)
    assert rel_error(out, ref) < TOL


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([1, 20, 16, 77], [1] * 4),
                                                  ([23, 30, 1, 40], [23, 30, 1, 40])],
                         ids=["decode", "prefill-no-prefix"])
def test_rope_write_into_an_fp8_cache(seq_lens: list[int], q_lens: list[int]) -> None:
    """The fused rotary + write quantizes the rotated keys and the values as the torch
    path (rotary, then :meth:`KVCacheLayer.write`) does; a prefill without a prefix then
    reads the keys from the fp8 cache, not from the QKV output."""
    heads, head_dim = 4 * KV_HEADS, 64
    case = make_case(seq_lens, q_lens, heads, KV_HEADS, head_dim, device=DEVICE, seed=5)
    md = case.metadata
    qkv = torch.randn(md.num_tokens, (heads + 2 * KV_HEADS) * head_dim,
                      generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = md.seq_lens.repeat_interleave(torch.tensor(q_lens, device=DEVICE)) - 1
    cos, sin = RotaryEmbedding(head_dim, RopeConfig()).to(DEVICE)(positions, torch.float32)
    cache = fp8_cache(case.cache)
    ours, ref = copy(cache), copy(cache)
    q = rope_write(qkv.clone(), heads, KV_HEADS, cos, sin, ours.key, ours.value,
                   md.slot_mapping, key_scale=ours.key_scale, value_scale=ours.value_scale)
    q_ref, k_ref = apply_rotary(qkv[:, :heads * head_dim].view(-1, heads, head_dim),
                                qkv[:, heads * head_dim:(heads + KV_HEADS) * head_dim]
                                .view(-1, KV_HEADS, head_dim), cos, sin)
    v = qkv[:, (heads + KV_HEADS) * head_dim:].reshape(-1, KV_HEADS, head_dim)
    ref.write(k_ref, v, md.slot_mapping, has_skipped=False)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    assert_same_cache(ours, ref)
    backend = TritonAttentionBackend()
    backend.prepare(md)
    out = backend.attend(q, ours, md, case.scale)
    torch_backend = TorchAttentionBackend()
    torch_backend.prepare(md)
    want = torch_backend.forward(q_ref, k_ref, v, copy(cache), md, case.scale)
    assert rel_error(out, want) < TOL
