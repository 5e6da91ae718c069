"""A tiny random Llama served by a real in-process gRPC shard, driven by the router engine."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random fp32 Llama (GQA 4/2 heads, 2 layers) with the default model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        # Large weights make attention sharp, so outputs depend on which K/V are read.
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture
async def tiny_shard_address(tiny_model_dir: Path) -> AsyncIterator[str]:
    """``host:port`` of a gRPC shard serving the tiny model (CPU, fp32, torch backend)."""
    from shard.config import ShardConfig
    from shard.server import start_server

    config = ShardConfig(model_path=str(tiny_model_dir), dtype="float32", device="cpu",
                         kv_cache_bytes=8 * 1024 * 1024)
    server, port = await start_server(config, host="127.0.0.1", port=0)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)
