"""The shard group's health as the supervisor last saw it, read without a shard call.

``GET /health``, the public gRPC health service and the API processes
(``--api-server-count``) ask :meth:`router.engine.loop.Engine.health_problem`, which reads
:class:`ShardHealth` here: probes answer at once from the known state and never call a
shard (a flood of probes costs the shards nothing; a stopped shard cannot make a probe
wait). The supervisor (:class:`router.launcher.Supervisor`), which pings every rank
every 0.5 s and restarts the group when one dies or hangs, records what it sees.

States: live; not answering (a liveness ping has waited more than
``NOT_ANSWERING_AFTER_S``); restarting; down (no restart left). Each change is logged
once, however many probes read it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from router.shard_client import ShardClient, ShardError

# Seconds a liveness ping may wait before the group counts as not answering. A rank
# answers a ping within milliseconds, even during a step (the shard's model work runs
# in a thread); the supervisor declares the rank dead after the ping's own timeout
# (router.executors.LIVENESS_TIMEOUT_S, 5 s) and restarts the group.
NOT_ANSWERING_AFTER_S = 1.0
# After a failed step, how often the engine asks the shards whether they answer, seconds.
SHARD_RECHECK_S = 0.1


class GroupState(enum.Enum):
    """What the supervisor last saw of the shard group."""

    LIVE = "live"
    NOT_ANSWERING = "not answering"
    RESTARTING = "restarting"
    DOWN = "down"


@dataclass(frozen=True)
class _Seen:
    """A state, since when (``time.monotonic()`` seconds), and its details."""

    state: GroupState
    since: float
    rank: int | None = None  # the rank not answering, when known
    reason: str = ""  # why the group is restarting or down


class ShardHealth:
    """The shard group's known health: written by the supervisor, read by probes.

    Every method returns at once; none calls a shard.

    Args:
        clock: Seconds on a monotonic clock (``time.monotonic``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen = _Seen(GroupState.LIVE, clock())

    @property
    def state(self) -> GroupState:
        """The current state."""
        return self._seen.state

    def live(self) -> None:
        """Every rank answered a liveness ping (or the group has just been started)."""
        self._enter(_Seen(GroupState.LIVE, self._clock()))

    def not_answering(self, rank: int | None, since: float) -> None:
        """A liveness ping sent at ``since`` (``time.monotonic()`` seconds) has no
        answer yet. ``rank``: the rank that does not answer, None when the ping went to
        several and it is not known which is silent. A later call while still not
        answering keeps the first ``since``."""
        if self._seen.state is GroupState.NOT_ANSWERING:
            return
        self._enter(_Seen(GroupState.NOT_ANSWERING, since, rank=rank))

    def restarting(self, reason: str) -> None:
        """The group is being stopped and started again because of ``reason`` (plain
        words, e.g. ``"shard rank 0 died or stopped answering"``)."""
        self._enter(_Seen(GroupState.RESTARTING, self._clock(), reason=reason))

    def down(self, reason: str) -> None:
        """The group is gone for good (no restart left, or the server is shutting
        down): ``reason`` says why."""
        self._enter(_Seen(GroupState.DOWN, self._clock(), reason=reason))

    def problem(self) -> str | None:
        """Why the shard group cannot serve now, in plain words, or None when it can."""
        seen = self._seen
        if seen.state is GroupState.LIVE:
            return None
        if seen.state is GroupState.NOT_ANSWERING:
            who = "a model shard" if seen.rank is None else f"model shard {seen.rank}"
            return f"{who} is not answering (for {self._clock() - seen.since:.1f} s)"
        if seen.state is GroupState.RESTARTING:
            return f"the shard group is restarting ({seen.reason})"
        return f"the shard group is down ({seen.reason})"

    def _enter(self, seen: _Seen) -> None:
        """Make ``seen`` the state; log the change (once: the same state again, as
        every liveness ping of a live group reports, is no change)."""
        before = self._seen
        if seen.state is before.state and seen.reason == before.reason:
            return
        self._seen = seen
        if seen.state is GroupState.LIVE:
            logger.info("health: the shard group answers again")
        else:
            logger.warning("health: {}; /health answers 503 and gRPC health NOT_SERVING",
                           self.problem())


def describe(shard_health: ShardHealth, draining: bool, steps_healthy: bool) -> str | None:
    """Why the server is not healthy, in plain words, or None when it is (``GET
    /health``, the gRPC health service and the API processes ask this).

    Answers at once from the known state, without a shard call: the shard group's health
    as the supervisor last saw it (a rank not answering, the group restarting or down),
    then draining (SIGTERM), then a recent failed step (``steps_healthy`` False).
    """
    problem = shard_health.problem()
    if problem is not None:
        return problem
    if draining:
        return "shutting down"
    if not steps_healthy:
        return "the last generation step failed"
    return None


async def until_shards_answer(client: ShardClient) -> None:
    """After a failed step, return once every rank answers ``Health`` (polled every
    ``SHARD_RECHECK_S``): the engine sends nothing meanwhile. A dead or hung rank is
    the supervisor's to find, and it stops the engine's loop to restart the group, so
    requests that arrive meanwhile wait in the queue for the new group instead of
    failing on the old one; a rank that answers again (a transient failure) lets the
    loop go on."""
    while True:
        try:
            await client.health()
            return
        except ShardError:
            await asyncio.sleep(SHARD_RECHECK_S)
