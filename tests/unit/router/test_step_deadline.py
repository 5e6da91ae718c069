"""The step deadline: fixed by --step-timeout, or adaptive to the steps measured."""

from __future__ import annotations

import pytest

from router.step_deadline import StepDeadline


def test_adaptive_deadline_follows_the_slowest_step() -> None:
    deadline = StepDeadline(floor_s=30.0, factor=10.0)
    assert deadline.seconds == 30.0  # nothing measured yet: the floor
    deadline.observe(0.5)
    assert deadline.seconds == 30.0  # 10 x 0.5 s is below the floor
    deadline.observe(7.0)
    deadline.observe(1.0)  # faster steps never shorten it
    assert deadline.seconds == 70.0


def test_fixed_deadline_ignores_measurements() -> None:
    deadline = StepDeadline(fixed_s=2.5)
    deadline.observe(100.0)
    assert deadline.seconds == 2.5


@pytest.mark.parametrize("fixed_s", [0.0, -1.0])
def test_non_positive_fixed_deadline_names_the_flag(fixed_s: float) -> None:
    with pytest.raises(ValueError, match="--step-timeout"):
        StepDeadline(fixed_s=fixed_s)
