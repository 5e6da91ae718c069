"""Default token budgets: long prompts are prefilled in chunks unless told otherwise."""

from __future__ import annotations

import pytest

from router.config import derive_budgets

UNSET: dict[str, int | None] = {
    "max_batch_prefill_tokens": None, "max_input_tokens": None, "max_total_tokens": None,
}


@pytest.mark.parametrize(("device_type", "chunk"), [("cpu", 512), ("cuda", 16384)])
def test_default_prefill_budget(device_type: str, chunk: int) -> None:
    """512 tokens a step on CPU; on GPU 16384, beyond the longest prompt (a step
    carries several)."""
    budgets = derive_budgets(UNSET, max_position_embeddings=8192, device_type=device_type)
    assert {name: budgets[name] for name in UNSET} == {
        "max_total_tokens": 4096, "max_input_tokens": 4095, "max_batch_prefill_tokens": chunk}
    longer = derive_budgets({**UNSET, "max_total_tokens": 32768}, 32768, device_type=device_type)
    assert longer["max_batch_prefill_tokens"] == {"cpu": 512, "cuda": 16384}[device_type]


@pytest.mark.parametrize(("kv_tokens", "batch"), [
    (None, 512),  # before the KV cache is sized: the graphs' bound
    (20_000, 64), (380_000, 371), (850_000, 512)])
def test_gpu_running_batch_follows_the_kv_capacity(kv_tokens: int | None, batch: int) -> None:
    budgets = derive_budgets(UNSET, 8192, kv_capacity_tokens=kv_tokens, device_type="cuda")
    assert budgets["max_batch_size"] == batch
    assert budgets["max_concurrent_requests"] == max(2 * batch, 128)
    assert budgets["waiting_served_ratio"] == 0.0


def test_cpu_defaults_and_given_values() -> None:
    budgets = derive_budgets(UNSET, 8192, kv_capacity_tokens=1 << 20, device_type="cpu")
    assert (budgets["max_batch_size"], budgets["waiting_served_ratio"],
            budgets["max_concurrent_requests"]) == (64, 0.3, 128)
    given = {**UNSET, "max_batch_size": 32, "waiting_served_ratio": 0.5,
             "max_concurrent_requests": 40}
    budgets = derive_budgets(given, 8192, kv_capacity_tokens=1 << 20, device_type="cuda")
    assert (budgets["max_batch_size"], budgets["waiting_served_ratio"],
            budgets["max_concurrent_requests"]) == (32, 0.5, 40)


def test_short_contexts_and_given_flags_keep_their_budgets() -> None:
    small = derive_budgets(UNSET, max_position_embeddings=300, device_type="cpu")
    assert small["max_batch_prefill_tokens"] == 300  # max_input_tokens + 1
    given = derive_budgets({**UNSET, "max_batch_prefill_tokens": 1000}, 8192, device_type="cpu")
    assert given["max_batch_prefill_tokens"] == 1000


def test_without_chunked_prefill_a_prompt_fits_one_step() -> None:
    budgets = derive_budgets(UNSET, 8192, chunked_prefill=False, device_type="cpu")
    assert budgets["max_batch_prefill_tokens"] == budgets["max_input_tokens"] == 4095


def test_speculation_stops_at_a_smaller_batch_on_a_cpu() -> None:
    assert derive_budgets(UNSET, 8192, device_type="cpu")["speculative_disable_batch_size"] == 4
    assert derive_budgets(UNSET, 8192, device_type="cuda")["speculative_disable_batch_size"] == 32
    given = {**UNSET, "speculative_disable_batch_size": 7}
    assert derive_budgets(given, 8192, device_type="cpu")["speculative_disable_batch_size"] == 7
