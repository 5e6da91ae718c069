"""The default ``--max-total-tokens`` is min(context, 4096, KV capacity): a KV cache too
small for 4096 tokens (but large enough for the worst-case prefill) starts the server with
the budget lowered to what it holds; a ``--max-total-tokens`` the cache cannot hold is a
start-up error naming the flags."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.live_server import launch_tiny

# The long tiny model (context 4096): 1 MiB of KV cache holds fewer than 4096 tokens and
# more than the CPU's default prefill budget (512).
SMALL_KV = ["--executor", "local", "--kv-cache-bytes", "1MiB"]


def test_default_total_tokens_shrink_to_the_kv_cache(tiny_long_model_dir: Path,
                                                      tmp_path: Path) -> None:
    server = launch_tiny(tiny_long_model_dir, tmp_path / "default.log", budgets=SMALL_KV)
    try:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        capacity = info["kv_blocks_total"] * info["block_size"]
        assert 512 < capacity < 4096, info
        assert info["max_total_tokens"] == capacity
        assert info["max_input_tokens"] == capacity - 1
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        too_long = {"inputs": "Hello", "parameters": {"max_new_tokens": capacity}}
        response = httpx.post(f"{server.url}/generate", json=too_long, timeout=60)
        assert response.status_code == 422 and "max_new_tokens" in response.text
    finally:
        server.stop()
    given = launch_tiny(tiny_long_model_dir, tmp_path / "given.log",
                        budgets=[*SMALL_KV, "--max-total-tokens", "4096"], wait=False)
    try:
        assert given.process.wait(timeout=120) != 0
        log = given.log()
        assert "max_total_tokens=4096: raise --kv-cache-bytes or lower" in log, log
        assert "--max-total-tokens" in log
    finally:
        given.stop()
