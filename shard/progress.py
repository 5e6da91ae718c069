"""Progress of long shard steps (warm-up) that would otherwise be silent.

:class:`PhaseProgress` announces each named phase as a log line (always, so Ray's
``log_to_driver`` and log files show it) and, on rank 0 with a terminal on stderr,
draws a tqdm bar over the phases whose elapsed time keeps ticking during a long phase.
Shard log lines go through :func:`tqdm_safe_write` so they never break the bar.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

from tqdm import tqdm

# Seconds between redraws of the bar (its elapsed time) during a long phase.
REFRESH_S = 0.5


def tqdm_safe_write(message: str) -> None:
    """A loguru sink: write ``message`` to stderr above any tqdm bar."""
    tqdm.write(message, file=sys.stderr, end="")


class PhaseProgress:
    """Phases of one step, numbered ``1/total``...

    Use as a context manager; call :meth:`phase` at the start of each phase.

    Args:
        name: What the step is ("warm-up").
        total: Number of phases.
        log: The shard's bound loguru logger.
        show_bar: Draw the bar (rank 0); it is drawn only when stderr is a terminal.
    """

    def __init__(self, name: str, total: int, log: Any, show_bar: bool) -> None:
        self.name = name
        self.total = total
        self.log = log
        self.done = 0
        self._bar = tqdm(total=total, desc=name, file=sys.stderr, unit="phase", leave=True,
                         disable=None if show_bar else True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {n}/{total} "
                                    "[{elapsed}]{postfix}")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name=f"{name} progress", daemon=True)

    def __enter__(self) -> PhaseProgress:
        if not self._bar.disable:
            self._ticker.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        if kind is None:
            self._bar.update(self.total - self._bar.n)
            self._bar.set_postfix_str("done")
        self._bar.close()

    def phase(self, text: str) -> None:
        """Phase ``text`` starts (the previous one, if any, is complete)."""
        if self.done:
            self._bar.update(1)
        self.done += 1
        self.log.info("{} {}/{}: {}", self.name, self.done, self.total, text)
        self._bar.set_postfix_str(text)

    def _tick(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._bar.refresh()
