"""Weight loading: sharded checkpoints with an index, missing tensors, dummy weights."""

from __future__ import annotations

import pytest
import torch

from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.weights import safetensors_files
from tests.unit.shard.helpers import make_runner


@pytest.fixture(autouse=True)
def dense_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the loaded weights themselves, so the CPU packing (which
    releases the dense copies; tested in test_cpu_packing.py) is turned off."""
    monkeypatch.setattr("shard.model_loader.pack_cpu_weights", lambda model: 0)


def test_sharded_checkpoint_loads_same_weights(tmp_path, llama) -> None:
    folder, hf = llama
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(safetensors_files(tmp_path)) > 1
    ours = make_runner(tmp_path, warmup=False).model.state_dict()
    ref = make_runner(folder, warmup=False).model.state_dict()
    assert ours.keys() == ref.keys()
    assert all(value.numel() > 0 for value in ref.values())
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name  # same device


def test_missing_tensor_is_named(tmp_path, llama) -> None:
    _, hf = llama
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.down_proj" not in k}
    hf.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(
        ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        make_runner(tmp_path, warmup=False)


def test_no_safetensors_suggests_dummy(tmp_path, llama) -> None:
    (tmp_path / "config.json").write_text((llama[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        make_runner(tmp_path, warmup=False)


def test_dummy_weights_from_config_alone(tmp_path, llama) -> None:
    (tmp_path / "config.json").write_text((llama[0] / "config.json").read_text())
    cfg = ShardConfig(
        model_path=str(tmp_path),
        device="cpu",
        load_format="dummy",
        block_size=4,
        kv_cache_bytes=1 << 20,
    )
    a, b = ModelRunner(cfg), ModelRunner(cfg)
    state_a, state_b = a.model.state_dict(), b.model.state_dict()
    for name, value in state_a.items():
        assert torch.equal(value, state_b[name]), name  # deterministic
    norm = state_a["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < float(state_a["model.embed_tokens.weight"].std()) < 0.025
    assert a.warmup(32, 64) == 512
