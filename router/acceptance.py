"""A request's speculative guesses and their acceptance (:class:`SpeculationStats`),
which decides when its speculation pauses (see :mod:`router.speculation`): when most of
its guesses are rejected, or when the tokens its speculative steps emit do not pay for
what such a step costs over a plain decode step."""

from __future__ import annotations

from dataclasses import dataclass

# Accepted / proposed guesses under which a request pauses its speculation, and the
# weight of the latest verify step in its moving average.
LOW_ACCEPTANCE = 0.2
ACCEPTANCE_WEIGHT = 0.3
# Decode steps a paused request runs without guesses before it tries again.
PAUSE_STEPS = 16


@dataclass
class SpeculationStats:
    """A request's guesses so far.

    Attributes:
        proposed: guesses proposed for it (all its verify steps).
        accepted: guesses accepted.
        acceptance: moving average of accepted / proposed over its verify steps (1.0
            before the first).
        emitted: moving average of the tokens its verify steps emitted (accepted + 1;
            None before the first).
        paused: decode steps left without guesses.
    """

    proposed: int = 0
    accepted: int = 0
    acceptance: float = 1.0
    emitted: float | None = None
    paused: int = 0

    def record(self, proposed: int, accepted: int, cost: float | None = None) -> None:
        """One verify step of the request: ``proposed`` guesses, ``accepted`` kept.
        ``cost``: what the step took over a plain decode step's time (a ratio; None:
        unknown). The request pauses when its acceptance falls under
        ``LOW_ACCEPTANCE``, or when its speculative steps emit fewer tokens than they
        cost in decode steps (a slow draft model: every guess a decode step's worth of
        time, and a third of them accepted)."""
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / proposed - self.acceptance)
        emitted = accepted + 1.0
        self.emitted = emitted if self.emitted is None else (
            self.emitted + ACCEPTANCE_WEIGHT * (emitted - self.emitted))
        if self.acceptance < LOW_ACCEPTANCE or (cost is not None and self.emitted < cost):
            self.paused = PAUSE_STEPS
            # one good step after the pause resumes it
            self.acceptance = max(self.acceptance, LOW_ACCEPTANCE)
            self.emitted = None
