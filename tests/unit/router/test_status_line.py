"""The periodic status line: throughputs over the interval, the state at its end, and
speculative decoding's acceptance when guesses were proposed in it."""

from __future__ import annotations

from typing import Any

from router.status_log import StatusLogger, _Sample


def sample(at: float, **values: float) -> _Sample:
    base: dict[str, Any] = dict(prompt_tokens=0.0, generation_tokens=0.0, running=0.0,
                                waiting=0.0, kv_used=0.0, kv_total=100.0, proposed=0.0,
                                accepted=0.0)
    return _Sample(at=at, **{**base, **values})


def test_the_line_says_the_acceptance_of_the_interval_only_when_guesses_were_made() -> None:
    status = StatusLogger(engine=None, interval_s=5.0)  # type: ignore[arg-type]
    before = sample(0.0, generation_tokens=100, proposed=1000, accepted=100)
    plain = status.line(before, sample(5.0, generation_tokens=600, running=2, kv_used=5,
                                       proposed=1000, accepted=100))
    assert plain == ("status: prompt 0.0 tok/s, generation 100.0 tok/s, running 2 reqs, "
                     "waiting 0 reqs, KV cache 5.0% used")
    spec = status.line(before, sample(5.0, generation_tokens=600, running=2, kv_used=5,
                                      proposed=1400, accepted=400))
    assert spec == plain + ", speculation 75% of 400 guesses accepted"
    assert status.line(before, before) is None  # idle: nothing logged
