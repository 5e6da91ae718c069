"""Default token budgets: long prompts are prefilled in chunks unless told otherwise."""

from __future__ import annotations

import pytest

from router.config import derive_budgets

UNSET: dict[str, int | None] = {
    "max_batch_prefill_tokens": None, "max_input_tokens": None, "max_total_tokens": None,
}


@pytest.mark.parametrize(("device_type", "chunk"), [("cpu", 512), ("cuda", 2048)])
def test_default_prefill_chunk_is_smaller_than_the_longest_prompt(
    device_type: str, chunk: int
) -> None:
    budgets = derive_budgets(UNSET, max_position_embeddings=8192, device_type=device_type)
    assert budgets == {"max_total_tokens": 4096, "max_input_tokens": 4095,
                       "max_batch_prefill_tokens": chunk}


def test_short_contexts_and_given_flags_keep_their_budgets() -> None:
    small = derive_budgets(UNSET, max_position_embeddings=300, device_type="cpu")
    assert small["max_batch_prefill_tokens"] == 300  # max_input_tokens + 1
    given = derive_budgets({**UNSET, "max_batch_prefill_tokens": 1000}, 8192, device_type="cpu")
    assert given["max_batch_prefill_tokens"] == 1000


def test_without_chunked_prefill_a_prompt_fits_one_step() -> None:
    budgets = derive_budgets(UNSET, 8192, chunked_prefill=False, device_type="cpu")
    assert budgets["max_batch_prefill_tokens"] == budgets["max_input_tokens"] == 4095
