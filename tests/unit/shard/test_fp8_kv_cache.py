"""The fp8 KV cache on the shard: its block size in bytes, the torch backend's paths
over it, the warm-up's block count, backend selection, and a tiny model reading its
context back from it (tolerance: a random model's logits within 20% of transformers',
as with fp8 weights; exact-token tests stay on the unquantized cache)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks.kernels.paged_cases import make_case, rel_error, run_backend
from shard.attention import AttentionSpec, select_backend
from shard.attention.base import FP8_KV_REFUSAL
from shard.attention.flash_attn_backend import FlashAttnBackend
from shard.attention.torch_backend import TorchAttentionBackend
from shard.config import ShardConfig
from shard.inputs import SeqChunk
from shard.kv_cache import KVCacheLayer, bytes_per_block
from shard.model_runner import ModelRunner
from shard.models.config import ModelConfig
from shard.quantization.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows
from tests.unit.shard.helpers import PROMPTS, hf_logits

LLAMA_8B = ModelConfig(architecture="LlamaForCausalLM", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       vocab_size=128256, max_position_embeddings=8192)


def test_an_fp8_block_takes_half_the_bytes_plus_its_scales() -> None:
    bf16 = bytes_per_block(LLAMA_8B, 16, torch.bfloat16)
    fp8 = bytes_per_block(LLAMA_8B, 16, FP8_DTYPE)
    assert bf16 == 2 * 32 * 16 * 8 * 128 * 2
    assert fp8 == 2 * 32 * 16 * 8 * (128 + 4)  # a float32 scale per token and head
    assert bf16 / fp8 == pytest.approx(1.94, abs=0.01)


def test_write_stores_each_head_vector_with_its_scale() -> None:
    cache = KVCacheLayer.zeros(4, 2, 3, 16, FP8_DTYPE)
    assert cache.quantized and cache.key_scale is not None and cache.value_scale is not None
    k = torch.randn(3, 3, 16) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    slots = torch.tensor([5, -1, 0])
    cache.write(k, -k, slots, has_skipped=True)
    flat_k, flat_s = cache.key.view(8, 3, 16), cache.key_scale.view(8, 3)
    q, s = quantize_rows(k)
    assert torch.equal(flat_k[5].float(), q[0].float()) and torch.equal(flat_s[0], s[2])
    assert flat_s[1:5].abs().sum() == 0  # slot -1 skipped
    back = dequantize_rows(flat_k[[5, 0]], flat_s[[5, 0]])
    assert rel_error(back, k[[0, 2]]) < 0.04  # every head to e4m3's precision
    assert torch.equal(cache.read_back(k, k)[0], dequantize_rows(q, s))
    with pytest.raises(ValueError, match="token-major"):
        KVCacheLayer.zeros(4, 2, 3, 16, FP8_DTYPE, head_major=True)


def _fp8(cache: KVCacheLayer) -> KVCacheLayer:
    (k, ks), (v, vs) = quantize_rows(cache.key), quantize_rows(cache.value)
    return KVCacheLayer(k, v, ks, vs)


@pytest.mark.parametrize(("seq_lens", "q_lens"), [([1, 20, 16, 77], [1] * 4),
                                                  ([23, 100, 9, 41], [23, 30, 1, 40])],
                         ids=["decode", "prefill-over-prefix"])
@pytest.mark.parametrize("consecutive", [False, True])
def test_torch_paths_agree_over_an_fp8_cache(seq_lens: list[int], q_lens: list[int],
                                             consecutive: bool) -> None:
    """By sequence (views of the cache, or gathered blocks) and batched (padded, or
    block by block) read the same fp8 values."""
    case = make_case(seq_lens, q_lens, 8, 2, 64, seed=7, consecutive=consecutive)
    cache = _fp8(case.cache)
    outs = []
    for by_sequence in (True, False):
        copy = KVCacheLayer(*(t.clone() for t in dataclasses.astuple(cache)))
        outs.append(run_backend(TorchAttentionBackend(by_sequence=by_sequence), case, copy))
    assert rel_error(outs[0], outs[1]) < 1e-5


def test_backends_say_whether_they_read_an_fp8_cache() -> None:
    spec = AttentionSpec(torch.device("cpu"), torch.float32, 4, 2, 64, 16,
                         kv_cache_dtype=FP8_DTYPE)
    assert FlashAttnBackend.supports(spec) == (False, FP8_KV_REFUSAL)
    backend, reason = select_backend("auto", spec)
    assert backend.name == "torch" and "flash_attn skipped: " + FP8_KV_REFUSAL in reason
    with pytest.raises(ValueError, match="cannot run this model: its kernels do not read"):
        select_backend("flash_attn", spec)


def _runner(folder: Path, kv_cache_dtype: str, dtype: str = "float32") -> ModelRunner:
    runner = ModelRunner(ShardConfig(model_path=str(folder), device="cpu", dtype=dtype,
                                     block_size=4, kv_cache_bytes=1 << 20,
                                     kv_cache_dtype=kv_cache_dtype))
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    return runner


@pytest.mark.parametrize(("dtype", "ratio"), [("float32", 64 / 20), ("bfloat16", 32 / 20)])
def test_the_same_budget_holds_more_blocks(llama, dtype: str, ratio: float) -> None:
    """head_dim 16: 16 bytes of e4m3 and a 4-byte scale against 64 (float32) or 32
    (bfloat16) bytes per head vector."""
    folder, _ = llama
    plain, fp8 = _runner(folder, "auto", dtype), _runner(folder, "fp8", dtype)
    assert fp8.num_blocks == int(plain.num_blocks * ratio)
    assert fp8.kv_cache[0].key.dtype == FP8_DTYPE and not fp8.kv_cache[0].head_major


def test_tiny_model_reads_its_context_from_an_fp8_cache(llama) -> None:
    folder, hf = llama
    prompt = PROMPTS[3]
    ref = hf_logits(hf, prompt)[20:]
    errors = []
    for kv in ("auto", "fp8"):
        runner = _runner(folder, kv)
        with torch.inference_mode():  # a prefix in the cache, then the rest over it
            runner.run_chunks([SeqChunk(prompt[:20], 0, list(range(10)))], is_prefill=True)
            _, hidden = runner.run_chunks([SeqChunk(prompt[20:], 20, list(range(10)))],
                                          is_prefill=True)
            errors.append(rel_error(runner.model.compute_logits(hidden), ref))
    assert errors[0] < 1e-5
    assert 1e-4 < errors[1] < 0.2, errors
