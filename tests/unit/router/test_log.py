"""``announce_wait``: a long wait says what it waits for, and stays quiet when told."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from loguru import logger

from router.log import announce_wait


@pytest.fixture
def lines() -> Iterator[list[str]]:
    captured: list[str] = []
    sink = logger.add(lambda message: captured.append(str(message)), format="{message}")
    yield captured
    logger.remove(sink)


async def test_long_wait_is_announced(lines: list[str]) -> None:
    assert await announce_wait(asyncio.sleep(0.35, "done"), "the thing", every_s=0.1) == "done"
    notes = [line for line in lines if line.startswith("still waiting for the thing (")]
    assert len(notes) >= 2


async def test_quiet_wait_and_short_wait_say_nothing(lines: list[str]) -> None:
    await announce_wait(asyncio.sleep(0.25), "the thing", every_s=0.1, quiet=True)
    await announce_wait(asyncio.sleep(0.01), "the thing", every_s=0.1)
    assert not [line for line in lines if "still waiting" in line]


async def test_errors_pass_through_and_cancelling_stops_the_work() -> None:
    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await announce_wait(fail(), "failure", every_s=0.1)
    work = asyncio.ensure_future(asyncio.sleep(10))
    waiter = asyncio.ensure_future(announce_wait(work, "cancellation", every_s=0.1))
    await asyncio.sleep(0.05)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert work.cancelled()
