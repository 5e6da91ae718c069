"""Our Llama-family model gives the same logits as transformers for the same weights."""

from __future__ import annotations

import pytest
import torch

from shard.inputs import SeqChunk
from tests.unit.shard.helpers import PROMPTS, BlockPool, hf_logits, make_runner

VARIANTS = [
    "llama", "llama_tied", "qwen2", "qwen3", "qwen3_tied", "mistral", "llama3_rope", "linear_rope"
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_batched(tiny_models, variant: str) -> None:
    folder, hf = tiny_models(variant)
    runner = make_runner(folder)
    pool = BlockPool(runner.num_blocks, seed=7)
    chunks = [SeqChunk(p, 0, pool.for_tokens(len(p))) for p in PROMPTS]
    with torch.inference_mode():
        inputs, hidden = runner.run_chunks(chunks, is_prefill=True)
        logits = runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    cu = inputs.metadata.cu_seqlens_q.tolist()
    for i, prompt in enumerate(PROMPTS):
        ref = hf_logits(hf, prompt)
        torch.testing.assert_close(logits[cu[i] : cu[i + 1]].cpu(), ref, atol=1e-5, rtol=1e-5)


def test_long_positions_llama3_rope(tiny_models) -> None:
    """Positions far beyond original_max_position_embeddings (32) exercise every band
    of the llama3 scaling."""
    folder, hf = tiny_models("llama3_rope")
    runner = make_runner(folder, kv_cache_bytes=8 * 1024 * 1024)
    prompt = [(7 * i) % 200 + 3 for i in range(150)]
    chunk = SeqChunk(prompt, 0, BlockPool(runner.num_blocks).for_tokens(len(prompt)))
    with torch.inference_mode():
        _, hidden = runner.run_chunks([chunk], is_prefill=True)
        logits = runner.model.compute_logits(hidden)
    torch.testing.assert_close(logits.cpu(), hf_logits(hf, prompt), atol=1e-5, rtol=1e-5)


def test_qwen2_bias_is_loaded(tiny_models) -> None:
    folder, hf = tiny_models("qwen2")
    runner = make_runner(folder, warmup=False)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None
    hf_attn = hf.model.layers[0].self_attn
    expected = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(qkv.bias.cpu(), expected)
    assert runner.model.model.layers[0].self_attn.o_proj.bias is None


def test_tied_embeddings_share_storage(tiny_models) -> None:
    folder, _ = tiny_models("llama_tied")
    runner = make_runner(folder, warmup=False)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


def test_logits_dtype_argument(tiny_models) -> None:
    """float32 by default; ``dtype=None`` (what a decode graph captures) leaves the LM
    head's product in the model's dtype, of which the default is the exact cast."""
    folder, _ = tiny_models("llama")
    runner = make_runner(folder, warmup=False)
    hidden = torch.randn(3, runner.model_config.hidden_size,
                         generator=torch.Generator().manual_seed(0)).to(runner.device)
    with torch.inference_mode():
        default = runner.model.compute_logits(hidden)
        uncast = runner.model.compute_logits(hidden, dtype=None)
        half = runner.model.compute_logits(hidden, dtype=torch.bfloat16)
    assert default.dtype == torch.float32 and uncast.dtype == runner.dtype
    assert torch.equal(uncast.to(torch.float32), default)
    assert half.dtype == torch.bfloat16 and torch.equal(half, default.to(torch.bfloat16))
