"""The server on the tiny random Llama with fp8 weights and an fp8 KV cache
(``--quantization fp8 --kv-cache-dtype fp8``, CPU): it says so in /info and in its log,
its KV budget holds more blocks, and it generates. Tolerance-based, not exact tokens:
greedy from the fp8 server picks one of the unquantized server's top 5 first tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.integration.live_server import launch_tiny

PROMPT = "The capital of France is"


def _serve(model_dir: Path, log: Path, args: list[str]) -> tuple[dict[str, Any], dict[str, Any],
                                                                    str]:
    """(/info, the /generate answer with details, the log) of a server with ``args``."""
    server = launch_tiny(model_dir, log, args)
    try:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        answer = httpx.post(f"{server.url}/generate", timeout=60, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True,
                                             "top_n_tokens": 5, "do_sample": False}}).json()
        return info, answer, server.log()
    finally:
        server.stop()


def test_fp8_weights_and_kv_cache_serve_and_say_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    plain_info, plain, _ = _serve(tiny_model_dir, tmp_path / "plain.log", [])
    info, answer, log = _serve(tiny_model_dir, tmp_path / "fp8.log",
                               ["--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert (plain_info["quantization"], plain_info["kv_cache_dtype"]) == ("none", "float32")
    assert plain_info["quantization_details"] == ""
    assert (info["quantization"], info["kv_cache_dtype"]) == ("fp8", "float8_e4m3fn")
    assert "fp8 weights" in info["quantization_details"]
    assert "scale per token and KV head" in info["quantization_details"]
    assert "fp8 weights: the decoder layers' linear weights in float8_e4m3fn" in log
    assert "fp8 KV cache" in log
    # 16-dim heads: 64 bytes per float32 head vector, 16 + a 4-byte scale in fp8
    assert info["kv_blocks_total"] == int(plain_info["kv_blocks_total"] * 64 / 20)
    assert answer["details"]["generated_tokens"] == 8
    first_top = {t["id"] for t in plain["details"]["top_tokens"][0]}
    assert answer["details"]["tokens"][0]["id"] in first_top
