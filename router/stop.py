"""Stop sequences on generated text, with hold-back for streaming.

A stop string can span tokens ("Pa" + "ris" for "Pari"), so matching is done on text.
Text that could still be the start of a stop string is held back: it is released only
once ruled out, so a streamed client never sees part of a stop sequence and the joined
stream equals the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopMatch:
    """Where generation stopped: the stop string and the text released before it."""

    stop: str
    released: str


@dataclass
class StopSequenceChecker:
    """Feed text deltas; get back text safe to release, or a match.

    Attributes:
        stop_sequences: Strings that end generation (empty strings are not allowed).
    """

    stop_sequences: list[str]
    _pending: str = field(default="", init=False)

    def __post_init__(self) -> None:
        assert all(self.stop_sequences), "stop sequences must be non-empty"
        self._max_len = max((len(s) for s in self.stop_sequences), default=0)

    def feed(self, delta: str) -> tuple[str, StopMatch | None]:
        """Add ``delta``; return (text to release now, match or None).

        On a match, the returned text is everything before the stop string that was not
        released earlier, and the checker must not be fed again.
        """
        if not self.stop_sequences:
            return delta, None
        self._pending += delta
        earliest: tuple[int, str] | None = None
        for stop in self.stop_sequences:
            index = self._pending.find(stop)
            if index >= 0 and (earliest is None or index < earliest[0]):
                earliest = (index, stop)
        if earliest is not None:
            index, stop = earliest
            released = self._pending[:index]
            self._pending = ""
            return released, StopMatch(stop=stop, released=released)
        hold = self._longest_partial_suffix()
        cut = len(self._pending) - hold
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released, None

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string completed)."""
        released, self._pending = self._pending, ""
        return released

    def _longest_partial_suffix(self) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of a stop."""
        text = self._pending
        for length in range(min(len(text), self._max_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self.stop_sequences):
                return length
        return 0
