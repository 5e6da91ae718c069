"""ShardConfig validation, environment overrides, CLI flags, model config parsing and
the model registry."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from shard.config import ShardConfig, default_cache_dir
from shard.config_flags import env_overrides, shard_argv
from shard.layers.rotary import compute_inv_freq
from shard.models.config import ModelConfig, RopeConfig
from shard.models.registry import get_model_class
from shard.server import config_from_args

HF = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "eos_token_id": [2, 7],
    "bos_token_id": 1,
}


def test_shard_config_defaults_and_resolution() -> None:
    c = ShardConfig(model_path="m")
    assert (c.block_size, c.kv_cache_bytes, c.gpu_memory_fraction, c.attention_backend) == (
        16,
        512 << 20,
        0.9,
        "auto",
    )
    assert (c.rank, c.world_size, c.load_format, c.served_model_id) == (0, 1, "safetensors", "m")
    cpu = ShardConfig(model_path="m", device="cpu")
    assert cpu.torch_device() == torch.device("cpu") and cpu.torch_dtype() == torch.float32
    assert ShardConfig(model_path="m", dtype="bfloat16").torch_dtype() == torch.bfloat16


def test_cuda_device_resolves_with_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_device and cuBLASLt's handles need an index: plain "cuda" takes the
    current device's, an explicit one stays, and TP ranks on one host take one GPU each."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert ShardConfig(model_path="m", device="cuda").torch_device() == torch.device("cuda", 3)
    assert ShardConfig(model_path="m").torch_device() == torch.device("cuda", 3)  # auto
    assert ShardConfig(model_path="m", device="cuda:1").torch_device() == torch.device("cuda", 1)
    rank1 = ShardConfig(model_path="m", device="cuda", rank=1, world_size=2)
    assert rank1.torch_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a Ray actor's one GPU
    assert rank1.torch_device() == torch.device("cuda", 3)
    assert ShardConfig(model_path="m", device="cuda").torch_dtype() == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"load_format": "pt"}, "load_format"),
        ({"pdl": "on"}, "pdl"),
    ],
)
def test_shard_config_rejects_bad_fields(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ShardConfig(model_path="m", **kwargs)


def test_env_overrides_are_typed_and_only_read_when_called() -> None:
    env = {
        "SHARDSERVE_ATTENTION_BACKEND": "auto",
        "SHARDSERVE_BLOCK_SIZE": "32",
        "OTHER": "x",
        "SHARDSERVE_GPU_MEMORY_FRACTION": "0.5",
    }
    assert env_overrides(env) == {
        "attention_backend": "auto",
        "block_size": 32,
        "gpu_memory_fraction": 0.5,
    }
    with pytest.raises(ValueError, match="SHARDSERVE_BLOCK_SIZE"):
        env_overrides({"SHARDSERVE_BLOCK_SIZE": "big"})


def test_cli_flags_and_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_KV_CACHE_BYTES", "1234")
    config, host, port = config_from_args(
        [
            "--model",
            "/m",
            "--port",
            "5001",
            "--host",
            "0.0.0.0",
            "--block-size",
            "8",
            "--dtype",
            "float32",
            "--load-format",
            "dummy",
            "--model-id",
            "x",
            "--attention-backend",
            "auto",
        ]
    )
    assert (host, port) == ("0.0.0.0", 5001)
    assert config == ShardConfig(
        model_path="/m",
        block_size=8,
        dtype="float32",
        load_format="dummy",
        model_id="x",
        attention_backend="auto",
        kv_cache_bytes=1234,
    )
    with pytest.raises(SystemExit):
        config_from_args(["--model", "/m", "--gpu-memory-fraction", "2"])


def test_argv_of_a_config_parses_back_to_it() -> None:
    """The local executor's argv and the shard's parser are one definition: every field
    survives the trip (each differs from its default here)."""
    config = ShardConfig(
        model_path="/models/m", model_id="served", dtype="bfloat16", device="cuda:1",
        load_format="dummy", world_size=4, attention_backend="triton", cuda_graphs="1,2,4",
        pdl="off", gemm_tuning="off", gemm_tuning_cache="/data/tuning", block_size=32,
        kv_cache_bytes=3 * 2**20 + 7, gpu_memory_fraction=0.55, json_logs=True, rank=3,
        master_addr="10.0.0.2", master_port=29500, parent_pid=4242,
        step_trace_dir="/data/trace", quantization="fp8", kv_cache_dtype="fp8",
        speculative_method="draft", speculative_model="/models/draft", ngram_max=5,
        ngram_min=3,
    )
    default = ShardConfig(model_path="-")
    same = [f.name for f in dataclasses.fields(ShardConfig)
            if getattr(config, f.name) == getattr(default, f.name)]
    assert not same, f"fields left at their default: {same}"
    argv = shard_argv(config, host="0.0.0.0", port=5001)
    assert config_from_args(argv, environ={}) == (config, "0.0.0.0", 5001)
    plain = ShardConfig(model_path="/m")
    assert config_from_args(shard_argv(plain, "h", 1), environ={})[0] == plain


def test_env_and_flags_take_sizes_and_switches() -> None:
    assert env_overrides({"SHARDSERVE_KV_CACHE_BYTES": "1GiB", "SHARDSERVE_JSON_LOGS": "false",
                          "SHARDSERVE_WORLD_SIZE": "2"}) == {
        "kv_cache_bytes": 2**30, "json_logs": False, "world_size": 2}
    assert env_overrides({"SHARDSERVE_JSON_LOGS": "on"}) == {"json_logs": True}
    with pytest.raises(ValueError, match="SHARDSERVE_JSON_LOGS"):
        env_overrides({"SHARDSERVE_JSON_LOGS": "maybe"})
    config, _, _ = config_from_args(["--model", "/m", "--kv-cache-bytes", "64MiB"], environ={})
    assert config.kv_cache_bytes == 64 * 2**20


def test_a_group_of_several_ranks_needs_a_rendezvous_port() -> None:
    group = ShardConfig(model_path="m", world_size=2)  # the launcher's template
    assert group.for_rank(1, "10.0.0.1", 29500) == ShardConfig(
        model_path="m", world_size=2, rank=1, master_addr="10.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match="master_port"):
        group.for_rank(1, "10.0.0.1", 0)
    with pytest.raises(ValueError, match="rank"):
        group.for_rank(2, "10.0.0.1", 29500)
    with pytest.raises(SystemExit):
        config_from_args(["--model", "/m", "--world-size", "2"], environ={})


def test_model_config_transformers4_spelling() -> None:
    cfg = {**HF, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    mc = ModelConfig.from_dict(cfg)
    assert mc.head_dim == 16 and mc.eos_token_ids == (2, 7) and mc.bos_token_id == 1
    assert mc.rope == RopeConfig(
        rope_type="linear", theta=500000.0, factor=2.0, original_max_position_embeddings=4096
    )
    assert not mc.attention_bias and not mc.tie_word_embeddings


def test_model_config_transformers5_spelling(tmp_path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(
        json.dumps({**HF, "head_dim": 32, "rope_parameters": rope})
    )
    mc = ModelConfig.from_pretrained(tmp_path)
    assert mc.head_dim == 32
    assert mc.rope == RopeConfig("llama3", 500000.0, 32.0, 1.0, 4.0, 8192)


def test_model_config_qwen2_bias_and_bad_rope() -> None:
    mc = ModelConfig.from_dict({**HF, "architectures": ["Qwen2ForCausalLM"]})
    assert mc.attention_bias and not mc.o_proj_bias
    with pytest.raises(
        ValueError, match="unsupported rope_type 'yarn'; supported: default, linear, llama3"
    ):
        ModelConfig.from_dict({**HF, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_model_config_qwen3_qk_norm_and_head_dim() -> None:
    qwen3 = {**HF, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128}
    mc = ModelConfig.from_dict(qwen3)
    assert mc.qk_norm and mc.head_dim == 128  # not hidden_size / heads = 16
    assert not (mc.attention_bias or mc.o_proj_bias)
    assert ModelConfig.from_dict({**qwen3, "attention_bias": True}).o_proj_bias
    assert get_model_class(mc).__name__ == "LlamaForCausalLM"
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert not ModelConfig.from_dict({**HF, "architectures": [arch]}).qk_norm


@pytest.mark.parametrize(
    ("extra", "layers"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"]}, "[1]"),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "[0, 1]"),
    ],
)
def test_model_config_rejects_sliding_window(extra: dict, layers: str) -> None:
    cfg = {**HF, "architectures": ["Qwen3ForCausalLM"], **extra}
    with pytest.raises(ValueError, match=re.escape(f"layers {layers} use sliding-window")):
        ModelConfig.from_dict(cfg)


def test_model_config_accepts_full_attention_layer_types() -> None:
    full = {"layer_types": ["full_attention"] * 2, "use_sliding_window": False}
    assert ModelConfig.from_dict({**HF, "architectures": ["Qwen3ForCausalLM"], **full}).qk_norm
    # use_sliding_window with max_window_layers past the last layer slides nowhere
    late = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}
    assert ModelConfig.from_dict({**HF, **late}).num_hidden_layers == 2


def test_model_registry_lists_supported() -> None:
    with pytest.raises(
        ValueError,
        match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM",
    ):
        get_model_class(ModelConfig.from_dict({**HF, "architectures": ["GPT2LMHeadModel"]}))


def test_rope_scalings_change_frequencies() -> None:
    default = compute_inv_freq(16, RopeConfig())
    linear = compute_inv_freq(16, RopeConfig("linear", factor=4.0))
    llama3 = compute_inv_freq(
        16, RopeConfig("llama3", factor=8.0, original_max_position_embeddings=32)
    )
    torch.testing.assert_close(linear, default / 4)
    assert llama3[0] == default[0] and llama3[-1] == default[-1] / 8  # high freq kept, low scaled
    assert default[1] / 8 < llama3[1] < default[1]  # medium band (wavelength 8..32) interpolated


def test_default_cache_dir_reads_the_home_folder_only_as_the_last_choice(monkeypatch):
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", "/data/cache")
    assert default_cache_dir() == Path("/data/cache")
    monkeypatch.delenv("SHARDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert default_cache_dir() == Path("/xdg/shardserve")
    monkeypatch.delenv("XDG_CACHE_HOME")
    with pytest.raises(RuntimeError, match="home"):
        default_cache_dir()
