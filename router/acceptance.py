"""A request's speculative guesses and their acceptance (:class:`SpeculationStats`),
which decides when its speculation pauses (see :mod:`router.speculation`)."""

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
        paused: decode steps left without guesses.
    """

    proposed: int = 0
    accepted: int = 0
    acceptance: float = 1.0
    paused: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of the request: ``proposed`` guesses, ``accepted`` kept."""
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / proposed - self.acceptance)
        if self.acceptance < LOW_ACCEPTANCE:
            self.paused = PAUSE_STEPS
            self.acceptance = LOW_ACCEPTANCE  # one good step after the pause resumes it
