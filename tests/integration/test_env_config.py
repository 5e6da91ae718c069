"""Flags from ``SHARDSERVE_<FLAG>`` variables reach a real server (sizes with units);
the shard processes it starts are unaffected by the router's variables."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.live_server import launch_tiny

# The tiny model: 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes per token.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def test_server_takes_its_flags_from_the_environment(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    env = {
        "SHARDSERVE_EXECUTOR": "local",
        "SHARDSERVE_MAX_TOTAL_TOKENS": "512",
        "SHARDSERVE_MAX_BATCH_PREFILL_TOKENS": "256",
        "SHARDSERVE_KV_CACHE_BYTES": "4MiB",
        "SHARDSERVE_BLOCK_SIZE": "32",
        "SHARDSERVE_MAX_CONCURRENT_REQUESTS": "7",
        "SHARDSERVE_SERVED_MODEL_NAME": "env-a env-b",
        "SHARDSERVE_JSON_OUTPUT": "true",
    }
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log", env=env, budgets=[])
    try:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["block_size"] == 32
        assert info["kv_blocks_total"] == 4 * 2**20 // (32 * TINY_KV_BYTES_PER_TOKEN)
        assert info["max_concurrent_requests"] == 7 and info["model_id"] == "env-a"
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert [model["id"] for model in models] == ["env-a", "env-b"]
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
    assert server.log().lstrip().startswith("{")  # JSON log lines (SHARDSERVE_JSON_OUTPUT)
