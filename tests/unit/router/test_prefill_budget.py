"""The prefill budget of a mixed step: sized from measured step times so that a step
that prefills while requests decode takes about the ITL target."""

from __future__ import annotations

import pytest

from router.prefill_budget import AUTO_TARGET_MIN_S, MIN_TOKENS, PrefillBudget


def test_nothing_measured_or_nothing_decoding_gives_the_whole_budget() -> None:
    budget = PrefillBudget(target_s=0.1)
    assert budget.tokens(4096, decoding=True) == 4096  # no cost per token measured yet
    budget.observe(1000, 0.5)
    assert budget.tokens(4096, decoding=False) == 4096  # no stream to protect
    assert budget.tokens(4096, decoding=True) == 200  # 0.1 s at 0.5 ms per token


@pytest.mark.parametrize("decode_s, per_token_s", [(0.004, 2e-5), (0.3, 6e-3)])
def test_the_budget_fits_a_linear_step_time_model(decode_s: float, per_token_s: float) -> None:
    """Steps of a device whose step takes decode_s + per_token_s × prompt tokens: after
    a few of them the chunk is what fills the (automatic) target, whatever sizes the
    earlier steps had."""
    budget = PrefillBudget()
    budget.observe(0, decode_s)
    target = max(3 * decode_s, AUTO_TARGET_MIN_S)
    assert budget.target() == pytest.approx(target)
    for tokens in (2048, 512, 100, 3000):
        budget.observe(tokens, decode_s + per_token_s * tokens)
        budget.observe(0, decode_s)
    chunk = budget.tokens(1 << 20, decoding=True)
    assert chunk == pytest.approx((target - decode_s) / per_token_s, rel=0.01)
    assert decode_s + per_token_s * chunk == pytest.approx(target, rel=0.01)


def test_rows_slower_than_the_target_still_let_a_prompt_go_on() -> None:
    budget = PrefillBudget(target_s=0.01)
    budget.observe(0, 0.05)  # the rows alone take longer than the target
    budget.observe(256, 0.05 + 256e-4)
    assert budget.tokens(4096, decoding=True) == MIN_TOKENS
    assert budget.tokens(16, decoding=True) == 16  # never above the most of one step


def test_the_target_follows_the_decode_step() -> None:
    budget = PrefillBudget()
    assert budget.target() is None
    budget.observe(0, 0.3)
    assert budget.target() == pytest.approx(0.9)
    for _ in range(40):
        budget.observe(0, 0.001)
    assert budget.target() == pytest.approx(AUTO_TARGET_MIN_S)


@pytest.mark.parametrize("target_s", [float("inf"), 1e308])
def test_a_target_beyond_any_step_gives_the_whole_budget(target_s: float) -> None:
    """--itl-target inf (accepted: it is positive) or one too large for a float once
    divided by the cost per token: every step may compute the most of one step."""
    budget = PrefillBudget(target_s=target_s)
    budget.observe(0, 0.01)
    budget.observe(512, 0.01 + 512e-4)
    assert budget.tokens(4096, decoding=True) == 4096


def test_a_cost_per_token_decayed_to_almost_nothing_gives_the_whole_budget() -> None:
    """Prefills that add nothing measurable to a decode step, thousands in a row, leave
    a cost per token of a few subnormal seconds: the budget is the most of one step."""
    budget = PrefillBudget(target_s=0.2)
    budget.observe(0, 0.05)
    budget.observe(512, 0.06)
    while budget.per_token_s is not None and budget.per_token_s > 1e-310:
        budget.observe(16, 0.01)  # faster than the decode step: adds 0 s
    assert budget.tokens(4096, decoding=True) == 4096


def test_the_automatic_target_waits_for_a_decode_step_of_the_rows_alone() -> None:
    """With requests decoding and no decode step measured, the automatic target (a
    number of decode steps) is unknown: no prompt tokens, so that the next step is one
    of the rows alone and measures it; a set target needs none."""
    budget = PrefillBudget()
    budget.observe(4096, 0.4)  # prompts computed, no decode step yet
    assert budget.tokens(16384, decoding=False) == 16384
    assert budget.tokens(16384, decoding=True) == 0
    budget.observe(0, 0.01)
    assert 0 < budget.tokens(16384, decoding=True) < 16384
    assert PrefillBudget(target_s=0.1).tokens(16384, decoding=True) == 16384
