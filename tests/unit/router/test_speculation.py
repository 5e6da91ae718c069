"""Which decode steps speculate and how far each request guesses (router.speculation),
and when a request pauses its guesses (router.acceptance)."""

from __future__ import annotations

from router.acceptance import LOW_ACCEPTANCE, PAUSE_STEPS, SpeculationStats
from router.config import SchedulerConfig
from router.request import GenerationRequest, SamplingParams, Sequence, StoppingParams
from router.speculation import lookahead


def seq(rid: int, prompt: int = 10, output: int = 0, max_new: int = 100,
        pending: int = 0) -> Sequence:
    s = Sequence(id=rid, request=GenerationRequest(
        tuple(range(prompt)), SamplingParams(), StoppingParams(max_new_tokens=max_new)))
    s.output_ids = list(range(output))
    s.pending_tokens = pending
    return s


def config(**kw: int) -> SchedulerConfig:
    return SchedulerConfig(**{"num_speculative_tokens": 3, "max_total_tokens": 512,
                              "max_input_tokens": 32, "speculative_disable_batch_size": 4,
                              **kw})


def test_guesses_stay_within_the_limits_of_each_request() -> None:
    rows = [seq(0), seq(1, output=97), seq(2, output=98),
            seq(3, prompt=30, output=480, max_new=1000), seq(4, output=96, pending=1)]
    # 3 guesses; 97 of 100 made: 2 (the step emits at most 3); 98: 1; 510 of 512 total:
    # 1; 96 made and one in flight: 2
    assert lookahead(config(speculative_disable_batch_size=8), rows) == {
        0: 3, 1: 2, 2: 1, 3: 1, 4: 2}
    assert lookahead(config(), rows) == {}  # more rows than the disable size
    assert lookahead(config(num_speculative_tokens=0), rows[:1]) == {}
    assert lookahead(config(), [seq(0, output=99)]) == {}  # no room for a guess anywhere


def test_a_paused_request_guesses_nothing_until_its_pause_ends() -> None:
    rows = [seq(0), seq(1)]
    rows[0].speculation.paused = 2
    assert lookahead(config(), rows) == {0: 0, 1: 3}
    assert lookahead(config(), rows) == {0: 0, 1: 3}
    assert rows[0].speculation.paused == 0
    assert lookahead(config(), rows) == {0: 3, 1: 3}


def test_mostly_rejected_guesses_pause_the_request() -> None:
    stats = SpeculationStats()
    for _ in range(3):
        stats.record(3, 3)
    assert stats.paused == 0 and stats.acceptance > 0.9
    while not stats.paused:
        stats.record(3, 0)
    assert stats.paused == PAUSE_STEPS and stats.acceptance == LOW_ACCEPTANCE
    assert (stats.proposed, stats.accepted) >= (12, 9)


def test_steps_that_cost_more_than_they_emit_pause_the_request() -> None:
    """A third of the guesses accepted is no reason to pause, unless each speculative
    step costs more decode steps than the tokens it emits (a slow draft)."""
    cheap, slow = SpeculationStats(), SpeculationStats()
    for _ in range(5):
        cheap.record(3, 1, cost=1.2)  # 2 tokens a step for 1.2 decode steps: it pays
        slow.record(3, 1, cost=4.5)  # 2 tokens for 4.5 decode steps: it does not
    assert cheap.paused == 0
    assert slow.paused > 0
    unknown = SpeculationStats()
    unknown.record(3, 1, cost=None)
    assert unknown.paused == 0
