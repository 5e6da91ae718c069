"""A tiny random Llama served by a real in-process gRPC shard, driven by the router engine."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest


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


@pytest.fixture
async def tiny_long_shard_address(tiny_long_model_dir: Path) -> AsyncIterator[str]:
    """``host:port`` of a gRPC shard serving the tiny 4096-token-context model."""
    from shard.config import ShardConfig
    from shard.server import start_server

    config = ShardConfig(model_path=str(tiny_long_model_dir), dtype="float32", device="cpu",
                         kv_cache_bytes=16 * 1024 * 1024)
    server, port = await start_server(config, host="127.0.0.1", port=0)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest.fixture(scope="session")
def repeating_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its attention and MLP outputs scaled by 0.08: its greedy
    text falls into runs of one token, between which it wanders (n-gram guesses are
    both accepted and rejected: the speculative decoding tests' model)."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.conftest import TOKENIZER_FILES

    folder = tmp_path_factory.mktemp("tiny-llama-repeating")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.08)
            layer.mlp.down_proj.weight.mul_(0.08)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder
