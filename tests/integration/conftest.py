"""A tiny random Llama served by a real in-process gRPC shard, driven by the router engine."""

from __future__ import annotations

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
