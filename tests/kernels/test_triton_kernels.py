"""Our Triton kernels against the ``torch`` backend on small random paged problems
(CPU: Triton's interpreter; GPU: compiled). Ragged lengths, permuted block tables,
partly filled last blocks, grouped-query ratios 1/3/4/8, head sizes 64/128."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.kernels.paged_cases import make_case, reference, rel_error, run_backend
from shard.attention.layer import Attention
from shard.attention.torch_backend import TorchAttentionBackend
from shard.attention.triton_backend import TritonAttentionBackend
from shard.kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    decode_attention,
    prefill_attention,
    rope_write,
    write_kv_cache,
)
from shard.kernels.rms_norm import add_rms_norm
from shard.kernels.silu_mul import silu_and_mul
from shard.layers import fused
from shard.layers.norm import RMSNorm
from shard.layers.rotary import RotaryEmbedding
from shard.models.config import RopeConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS = 2
TOL = 1e-5 if DEVICE == "cpu" else 1e-4  # fp32 everywhere; "ieee" dots on the GPU

# decode: 1 token, a partly filled block, exactly one block, several tiles
DECODE_SEQS = [1, 20, 16, 77]
# prefill: plain, over a cached prefix (spanning full tiles), one new token, 2 query tiles
PREFILL_SEQS, PREFILL_QS = [23, 100, 9, 41], [23, 30, 1, 40]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "an output element was not written"
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backend_decode(group: int, head_dim: int) -> None:
    case = make_case(DECODE_SEQS, [1] * 4, group * KV_HEADS, KV_HEADS, head_dim, device=DEVICE,
                     seed=group * 1000 + head_dim)
    ref, ref_cache = reference(case)
    cache = case.fresh_cache()
    out = run_backend(TritonAttentionBackend(), case, cache)
    _check(out, ref)
    assert torch.equal(cache.key, ref_cache.key) and torch.equal(cache.value, ref_cache.value)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backend_prefill_over_cached_prefix(group: int, head_dim: int) -> None:
    case = make_case(PREFILL_SEQS, PREFILL_QS, group * KV_HEADS, KV_HEADS, head_dim,
                     device=DEVICE, seed=group * 7 + head_dim)
    ref, _ = reference(case)
    out = run_backend(TritonAttentionBackend(), case, case.fresh_cache())
    _check(out, ref)


@pytest.mark.parametrize("group", [1, 4])
def test_backend_mixed_step(group: int) -> None:
    """Prompt chunks, then decoding rows marked as such (a mixed step): the rows go
    through the decode kernel, the chunks through the prefill kernel, one output."""
    seqs, qs = [*PREFILL_SEQS, *DECODE_SEQS], [*PREFILL_QS, 1, 1, 1, 1]
    case = make_case(seqs, qs, group * KV_HEADS, KV_HEADS, 64, device=DEVICE, seed=group)
    ref, _ = reference(case)
    case = dataclasses.replace(case, metadata=dataclasses.replace(
        case.metadata, decode_rows=len(DECODE_SEQS), decode_max_seqlen_k=max(DECODE_SEQS)))
    calls: list[str] = []
    backend = TritonAttentionBackend()
    kern = backend._attention

    class Recording:
        def __getattr__(self, name: str) -> object:
            if name.endswith("_attention"):
                calls.append(name)
            return getattr(kern, name)

    backend._attention = Recording()  # type: ignore[assignment]
    out = run_backend(backend, case, case.fresh_cache())
    _check(out, ref)
    assert calls == ["prefill_attention", "decode_attention"]


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(target_programs=1),  # one split: direct write, no combine
        DecodeConfig(block_n=16, target_programs=10**6),  # a split per tile, some empty
        DecodeConfig(block_n=32, target_programs=24, max_splits=3),
        DecodeConfig(target_programs=1, heads_first=False),
        DecodeConfig(block_n=32, target_programs=24, max_splits=3, heads_first=False),
    ],
    ids=["one-split", "split-per-tile", "three-splits", "sequences-first",
         "sequences-first-splits"],
)
def test_decode_split_counts(config: DecodeConfig) -> None:
    case = make_case([5, 50, 33, 120, 64], [1] * 5, 8, 2, 64, block_size=8, device=DEVICE,
                     seed=3)
    ref, _ = reference(case)
    cache = case.fresh_cache()
    write_kv_cache(case.k, case.v, cache.key, cache.value, case.metadata.slot_mapping)
    md = case.metadata
    out = torch.full_like(case.q, float("nan"))
    decode_attention(case.q, cache.key, cache.value, md.block_tables, md.seq_lens,
                     md.max_seqlen_k, case.scale, out=out, config=config)
    _check(out, ref)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_small_tiles(block_size: int) -> None:
    """16x16 tiles: many query and key tiles per sequence, diagonal and full tiles."""
    case = make_case([70, 37, 3], [50, 37, 2], 4, 1, 64, block_size=block_size, device=DEVICE,
                     seed=block_size)
    ref, _ = reference(case)
    cache = case.fresh_cache()
    write_kv_cache(case.k, case.v, cache.key, cache.value, case.metadata.slot_mapping)
    md = case.metadata
    out = torch.full_like(case.q, float("nan"))
    prefill_attention(case.q, cache.key, cache.value, md.block_tables, md.cu_seqlens_q,
                      md.seq_lens, md.max_seqlen_q, case.scale, out=out,
                      config=PrefillConfig(block_m=16, block_n=16))
    _check(out, ref)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reads_new_kv_without_a_prefix(group: int) -> None:
    """``new_kv``: queries, keys and values as strided views of one QKV-like buffer (as
    the server passes them), keys and values never read from the cache (NaN here),
    ragged lengths over several query and key tiles; the same bits as through the cache
    in the same configuration (so a sequence's result does not depend on which source
    its batch took)."""
    lens = [70, 37, 3, 16]
    case = make_case(lens, lens, group * KV_HEADS, KV_HEADS, 64, device=DEVICE, seed=group)
    ref, _ = reference(case)
    md = case.metadata
    qkv = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    heads = group * KV_HEADS
    k = qkv[:, heads * 64:(heads + KV_HEADS) * 64].view(-1, KV_HEADS, 64)
    v = qkv[:, (heads + KV_HEADS) * 64:].view(-1, KV_HEADS, 64)
    assert not k.is_contiguous()
    q = qkv[:, :heads * 64].view(-1, heads, 64)
    outs = []
    for new_kv in (None, (k, v)):
        cache = case.fresh_cache()
        write_kv_cache(case.k, case.v, cache.key, cache.value, md.slot_mapping)
        if new_kv is not None:
            cache.key.fill_(float("nan"))
            cache.value.fill_(float("nan"))
        outs.append(torch.full_like(case.q, float("nan")))
        prefill_attention(q, cache.key, cache.value, md.block_tables, md.cu_seqlens_q,
                          md.seq_lens, md.max_seqlen_q, case.scale, out=outs[-1],
                          new_kv=new_kv)
    _check(outs[1], ref)
    assert torch.equal(outs[0], outs[1])


def test_cache_write_skips_negative_slots() -> None:
    key = torch.zeros(3, 2, 1, 4, device=DEVICE)
    value = torch.zeros_like(key)
    k = torch.arange(12, dtype=torch.float32, device=DEVICE).view(3, 1, 4) + 1
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    write_kv_cache(k, -k, key, value, slots)
    flat = key.view(6, 4)
    assert flat[5].tolist() == k[0, 0].tolist() and flat[0].tolist() == k[2, 0].tolist()
    assert flat[1:5].abs().sum().item() == 0 and torch.equal(value, -key)


def test_cache_write_strided_input_and_dtype_cast() -> None:
    """k/v as views of a fused qkv projection, written into a bf16 cache."""
    qkv = torch.randn(5, 3, 2, 8, device=DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    key = torch.zeros(4, 2, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    value = torch.zeros_like(key)
    slots = torch.tensor([7, 0, 3, 4, 1], device=DEVICE)
    write_kv_cache(k, v, key, value, slots)
    # NOTE: within one bf16 step, not equal: the interpreter truncates where CUDA rounds
    one_ulp = {"atol": 0.0, "rtol": 2.0**-7}
    torch.testing.assert_close(key.view(8, 2, 8)[slots].float(), k, **one_ulp)
    torch.testing.assert_close(value.view(8, 2, 8)[slots].float(), v, **one_ulp)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("seq_lens", "q_lens"), [(DECODE_SEQS, [1] * 4),
                                                  (PREFILL_SEQS, PREFILL_QS),
                                                  (PREFILL_QS, PREFILL_QS)],
                         ids=["decode", "prefill-over-prefix", "prefill-no-prefix"])
def test_fused_rope_write_matches_the_unfused_layer(
    qk_norm: bool, seq_lens: list[int], q_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The layer from the QKV output: Triton fuses q/k norms, rotary and the cache write
    # into one kernel; the torch backend runs them one by one (the reference). A prefill
    # with no cached prefix reads the rotated keys from the QKV output, not the cache.
    heads, head_dim = 4 * KV_HEADS, 64
    case = make_case(seq_lens, q_lens, heads, KV_HEADS, head_dim, device=DEVICE, seed=5)
    gen = torch.Generator().manual_seed(1)
    t = case.metadata.num_tokens
    qkv = torch.randn(t, (heads + 2 * KV_HEADS) * head_dim, generator=gen).to(DEVICE)
    positions = case.metadata.seq_lens.repeat_interleave(
        torch.tensor(q_lens, device=DEVICE)) - 1  # any distinct angles will do
    cos, sin = RotaryEmbedding(head_dim, RopeConfig()).to(DEVICE)(positions, torch.float32)
    norms = [None, None]
    if qk_norm:
        norms = [RMSNorm(head_dim, 1e-6).to(DEVICE) for _ in range(2)]
        for norm in norms:
            norm.weight.data = torch.rand(head_dim, generator=gen).to(DEVICE) + 0.5
    outs, caches = [], []
    triton_backend = TritonAttentionBackend()
    sources: list[bool] = []
    prefill = triton_backend._attention.prefill_attention

    def spy(*args, new_kv=None, **kwargs):  # type: ignore[no-untyped-def]
        sources.append(new_kv is not None)
        return prefill(*args, new_kv=new_kv, **kwargs)

    monkeypatch.setattr(triton_backend._attention, "prefill_attention", spy)
    for backend in (triton_backend, TorchAttentionBackend()):
        layer = Attention(backend, heads, KV_HEADS, head_dim, case.scale)
        layer.kv_cache = case.fresh_cache()
        backend.prepare(case.metadata)
        with torch.inference_mode():
            outs.append(layer.forward_qkv(qkv.clone(), cos, sin, case.metadata, *norms))
        caches.append(layer.kv_cache)
    assert sources == ([seq_lens == q_lens] if case.metadata.is_prefill else [])
    _check(outs[0], outs[1])
    assert rel_error(caches[0].key, caches[1].key) < TOL
    assert torch.equal(caches[0].value, caches[1].value)


def test_fused_rope_write_skips_negative_slots_and_casts() -> None:
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, RopeConfig()).to(DEVICE)(
        torch.tensor([0, 5, 9], device=DEVICE), torch.float32)
    key = torch.zeros(2, 4, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    value = torch.zeros_like(key)
    slots = torch.tensor([6, -1, 1], device=DEVICE)
    q = rope_write(qkv, heads, kv_heads, cos, sin, key, value, slots)
    assert q.shape == (3, heads, head_dim) and q.dtype == torch.float32
    v = qkv[:, (heads + kv_heads) * head_dim:].view(3, kv_heads, head_dim)
    flat = value.view(-1, kv_heads, head_dim)
    # bfloat16 rounding (the interpreter truncates where the GPU rounds to nearest)
    for slot, row in ((6, 0), (1, 2)):
        torch.testing.assert_close(flat[slot].float(), v[row], rtol=1e-2, atol=1e-2)
    written = {1, 6}
    assert all(not flat[s].any() and not key.view(-1, kv_heads, head_dim)[s].any()
               for s in range(8) if s not in written)
    # k_in_place: every token's keys rotated in qkv, the one not written to the cache too
    # (a prefill that recomputes a cached token reads it from there)
    in_place = qkv.clone()
    rope_write(in_place, heads, kv_heads, cos, sin, key, value, slots, k_in_place=True)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(3, kv_heads, head_dim)
    q0 = qkv[:, :heads * head_dim].view(3, heads, head_dim)
    _, rotated = fused.apply_rotary(q0, k, cos.view(3, 1, head_dim), sin.view(3, 1, head_dim))
    torch.testing.assert_close(
        in_place[:, heads * head_dim:(heads + kv_heads) * head_dim].view(3, kv_heads, head_dim),
        rotated, rtol=1e-5, atol=1e-5)
    assert torch.equal(in_place[:, :heads * head_dim], qkv[:, :heads * head_dim])
    assert torch.equal(in_place[:, (heads + kv_heads) * head_dim:],
                       qkv[:, (heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("d", [64, 1000, 2304])
def test_silu_and_mul_kernel_matches_eager(num_tokens: int, d: int) -> None:
    x = torch.randn(num_tokens, 2 * d, generator=torch.Generator().manual_seed(d)).to(DEVICE)
    got = silu_and_mul(x)
    want = fused.silu_and_mul.eager(x)  # type: ignore[attr-defined]
    assert got.shape == want.shape == (num_tokens, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_kernel_matches_eager(
    num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool
) -> None:
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(DEVICE)
    if with_residual:
        result = add_rms_norm(x, residual, weight, 1e-5)
        assert result is not None
        got, total = result
        want, want_total = fused.add_rms_norm.eager(x, residual, weight, 1e-5)  # type: ignore[attr-defined]
        assert total is not None
        # the sum is one rounded add: exact, except that Triton's interpreter truncates
        # float32 -> bfloat16 where the GPU rounds to nearest even (one ulp)
        exact = dtype == torch.float32 or DEVICE == "cuda"
        torch.testing.assert_close(total, want_total, rtol=0 if exact else 2**-7,
                                   atol=0 if exact else 2**-7)
    else:
        result = add_rms_norm(x, None, weight, 1e-5)
        assert result is not None
        got, total = result
        want = fused.rms_norm.eager(x, weight, 1e-5)  # type: ignore[attr-defined]
        assert total is None
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    # float32 sums in another order; in bfloat16 that can move a rounding by an ulp
    # (2^-7 relative; the interpreter's truncation: up to two roundings, 2^-6)
    bf16_tol = 2**-7 if DEVICE == "cuda" else 2**-5
    tol = 1e-5 if dtype == torch.float32 else bf16_tol
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_rms_norm_kernel_declines_rows_it_does_not_take() -> None:
    # None sends RMSNorm to the compiled reference: never a wrong or partial result
    x = torch.randn(3, 64).to(DEVICE)
    weight = torch.ones(64).to(DEVICE)
    assert add_rms_norm(x, None, weight, 1e-5) is not None
    assert add_rms_norm(x.view(3, 8, 8), None, weight[:8], 1e-5) is None  # per-head rows
    assert add_rms_norm(x, None, weight.to(torch.bfloat16), 1e-5) is None  # weight dtype
    assert add_rms_norm(x, x.to(torch.bfloat16), weight, 1e-5) is None  # residual dtype
    assert add_rms_norm(x, x[:2], weight, 1e-5) is None  # residual shape
    assert add_rms_norm(x.t().contiguous().t(), None, weight, 1e-5) is None  # strided rows
    wide = torch.randn(1, 32768 * 2).to(DEVICE)
    assert add_rms_norm(wide, None, torch.ones(32768 * 2).to(DEVICE), 1e-5) is None


@pytest.mark.parametrize("num_kv_heads", [2, 8, 32])
def test_split_classes_reach_every_decode_kernel_variant(num_kv_heads: int) -> None:
    # the variants decode_attention launches are one split, or the combine kernel's
    # split count padded to a power of two: warm-up's contexts reach each exactly once
    from shard.kernels.attention.decode import num_decode_splits, split_classes

    config = DecodeConfig()

    def variant(context: int, batch: int = 1) -> int:
        splits = num_decode_splits(batch, num_kv_heads, context, config)
        return 1 if splits == 1 else max(2, 1 << (splits - 1).bit_length())

    contexts = split_classes(num_kv_heads, 4096)
    assert contexts == sorted(contexts) and max(contexts) <= 4096
    reached = [variant(c) for c in contexts]
    assert len(set(reached)) == len(reached)
    every = {variant(c, b) for c in range(1, 4097, 7) for b in (1, 2, 5, 16, 64, 256)}
    assert set(reached) == every
    assert TritonAttentionBackend().eager_decode_contexts(num_kv_heads, 4096) == contexts
    assert TorchAttentionBackend().eager_decode_contexts(num_kv_heads, 4096) == []
    # a maximum shorter than a tile: one context, no longer than it
    assert split_classes(num_kv_heads, 40) == [40]
