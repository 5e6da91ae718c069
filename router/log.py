"""One loguru sink for the router: readable lines, or JSON lines with ``--json-output``;
and :func:`announce_wait`, so a long wait is never silent."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable
from typing import TypeVar

from loguru import logger

T = TypeVar("T")
# Seconds between "still waiting" lines.
STILL_WAITING_S = 15.0


def setup_logging(json_output: bool = False, level: str = "INFO") -> None:
    """Replace loguru's default sink with one on stderr."""
    logger.remove()
    logger.add(sys.stderr, level=level, serialize=json_output, backtrace=False, diagnose=False)


async def announce_wait(work: Awaitable[T], what: str, every_s: float = STILL_WAITING_S,
                        quiet: bool = False) -> T:
    """Await ``work``, logging "still waiting for <what> (N s)" every ``every_s`` seconds
    unless ``quiet`` (for example while a shard draws a progress bar on this terminal).

    Raises:
        Whatever ``work`` raises.
    """
    task = asyncio.ensure_future(work)
    started = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if not quiet:
                logger.info("still waiting for {} ({:.0f} s)", what, time.monotonic() - started)
    finally:
        task.cancel()  # no-op once done; stops the work if this wait is cancelled
