"""Qwen3 dense models (``Qwen3ForCausalLM``): per-head q/k RMSNorm before rotary, an
explicit head_dim, optional tied embeddings. The same greedy tokens as transformers
``generate`` alone and batched, at TP=1 and TP=2 (gloo), and loading from safetensors or
dummy weights. Logits are checked in test_model_logits.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.models.config import ModelConfig
from tests.unit.shard.conftest import NEW_TOKENS
from tests.unit.shard.helpers import (
    PROMPTS,
    BlockPool,
    DecodeDriver,
    hf_greedy,
    make_runner,
    prefill,
    request,
)
from tests.unit.shard.tp_harness import run_tp

TinyModels = Callable[[str], tuple[Path, PreTrainedModel]]
VARIANTS = ["qwen3", "qwen3_tied"]


@pytest.fixture(scope="module")
def expected(tiny_models: TinyModels) -> dict[str, list[list[int]]]:
    """transformers greedy tokens (NEW_TOKENS each) per variant and prompt."""
    return {
        v: [hf_greedy(tiny_models(v)[1], p, NEW_TOKENS) for p in PROMPTS] for v in VARIANTS
    }


def test_config_geometry(tiny_models: TinyModels) -> None:
    mc = ModelConfig.from_pretrained(tiny_models("qwen3")[0])
    assert mc.architecture == "Qwen3ForCausalLM" and mc.qk_norm
    assert (mc.hidden_size, mc.num_attention_heads, mc.head_dim) == (64, 4, 32)
    assert not (mc.attention_bias or mc.o_proj_bias or mc.tie_word_embeddings)
    assert ModelConfig.from_pretrained(tiny_models("qwen3_tied")[0]).tie_word_embeddings


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_loaded(tiny_models: TinyModels, variant: str, monkeypatch) -> None:
    """q_norm / k_norm come from the checkpoint (not left at their initial ones)."""
    monkeypatch.setattr("shard.model_loader.pack_cpu_weights", lambda model: 0)
    folder, hf = tiny_models(variant)
    model = make_runner(folder, warmup=False).model
    for ours, ref in zip(model.model.layers, hf.model.layers, strict=True):
        attn, hf_attn = ours.self_attn, ref.self_attn
        assert attn.q_norm is not None and attn.k_norm is not None
        assert torch.equal(attn.q_norm.weight.cpu(), hf_attn.q_norm.weight)
        assert torch.equal(attn.k_norm.weight.cpu(), hf_attn.k_norm.weight)
        assert not torch.equal(hf_attn.q_norm.weight, torch.ones_like(hf_attn.q_norm.weight))
        assert attn.qkv_proj.bias is None and attn.o_proj.bias is None
        expected = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
        assert torch.equal(attn.qkv_proj.weight.cpu(), expected)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (variant == "qwen3_tied")


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_alone_matches_transformers(
    tiny_models: TinyModels, expected: dict[str, list[list[int]]], variant: str
) -> None:
    runner = make_runner(tiny_models(variant)[0])
    for index, prompt in enumerate(PROMPTS):
        pool = BlockPool(runner.num_blocks, seed=index)
        tokens = [prefill(runner, request(10, prompt, pool.for_tokens(len(prompt))))[10]]
        driver = DecodeDriver(runner, pool)
        while len(tokens) < NEW_TOKENS:
            tokens.append(driver.step()[10])
        assert driver.step(finished=(10,)) == {} and len(runner.requests) == 0
        assert tokens == expected[variant][index], f"prompt {index}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_batched_matches_transformers(
    tiny_models: TinyModels, expected: dict[str, list[list[int]]], variant: str
) -> None:
    runner = make_runner(tiny_models(variant)[0])
    pool = BlockPool(runner.num_blocks, seed=3)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(PROMPTS)]
    got = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for _ in range(NEW_TOKENS - 1):
        for rid, tok in driver.step().items():
            got[rid].append(tok)
    assert [got[i] for i in range(len(PROMPTS))] == expected[variant]


def test_tp2_matches_tp1_and_transformers(
    tiny_models: TinyModels, expected: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """head_dim 32 != hidden/heads; query and KV heads split over 2 ranks, q/k norms
    replicated. Tokens for every batch composition equal TP=1's and transformers'."""
    folder = tiny_models("qwen3")[0]
    new_tokens = 12
    tp1 = run_tp(folder, 1, PROMPTS, new_tokens, tmp_path)
    tp2 = run_tp(folder, 2, PROMPTS, new_tokens, tmp_path)
    ref, got = tp1["logits"], tp2["logits"]
    assert float((ref - got).abs().max() / ref.abs().max()) <= 1e-4
    reference = [tokens[:new_tokens] for tokens in expected["qwen3"]]
    for key in ("alone", "together", "joined"):
        assert tp1[key] == reference, f"TP=1 {key}"
        assert tp2[key] == reference, f"TP=2 {key}"


def test_dummy_weights_from_config_alone(tiny_models: TinyModels, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_models("qwen3")[0] / "config.json").read_text())
    runner = ModelRunner(
        ShardConfig(
            model_path=str(tmp_path),
            device="cpu",
            load_format="dummy",
            block_size=4,
            kv_cache_bytes=1 << 20,
        )
    )
    state: dict[str, Any] = runner.model.state_dict()
    for name in ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"):
        assert torch.equal(state[f"model.{name}"], torch.ones(32)), name
    # KV blocks sized by head_dim 32: 1 MiB / (2 layers * K,V * 4 tokens * 2 heads * 32 * 4 B)
    assert runner.warmup(32, 64) == 256
    pool = BlockPool(runner.num_blocks)
    first = prefill(runner, request(1, PROMPTS[2], pool.for_tokens(len(PROMPTS[2]))))
    assert 0 <= first[1] < 256
