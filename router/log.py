"""One loguru sink for the router: readable lines, or JSON lines with ``--json-output``."""

from __future__ import annotations

import sys

from loguru import logger


def setup_logging(json_output: bool = False, level: str = "INFO") -> None:
    """Replace loguru's default sink with one on stderr."""
    logger.remove()
    logger.add(sys.stderr, level=level, serialize=json_output, backtrace=False, diagnose=False)
