"""The standard gRPC health ``Watch`` (``grpc.health.v1.Health/Watch``) through Ray
Serve's gRPC proxy.

The proxy calls the ingress's ``Watch`` with the decoded request and relays each message
it yields. The ingress answers it itself: every ``WATCH_REFRESH_S`` it asks a replica
the same ``Check`` a client would (:func:`watch_statuses`), and yields a message when
the status changes, the first at once, as the one-replica server's ``Watch`` does
(:class:`router.grpc_api.server.HealthServicer`). A replica's answer is that of its
own health service (SERVING while its ``GET /health`` answers 200); a service it does
not know is SERVICE_UNKNOWN; no answer within ``PROBE_TIMEOUT_S`` (no replica running,
or the one asked was lost) is NOT_SERVING.

NOTE: a ``Watch`` never ends by itself, and Ray Serve stops a replica only once every
call it holds has ended (the ingress waits up to ``INGRESS_DRAIN_LIMIT_S``): left
open, ``Watch`` streams would hold a stopping ingress that long, so ``shardserve
serve`` could not stop and a rolling restart would leave the old ingress behind. So a
stream ends with UNAVAILABLE once Ray Serve lists its ingress replica as stopping
(:class:`StopSign`); the client watches again and reaches the ingress that replaced it
(gRPC's client-side health checking retries any status but UNIMPLEMENTED, with
backoff: https://github.com/grpc/proposal/blob/master/A17-client-side-health-checking.md).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from loguru import logger

from router.grpc_api.server import WATCH_REFRESH_S

# Seconds a replica has to answer one health check of a Watch stream.
PROBE_TIMEOUT_S = 5.0
# What a Watch stream that ends because its ingress is stopping is told.
INGRESS_STOPPING = "this ingress replica is stopping; call Watch again to reach its successor"
# Ray Serve's replica states (``ray.serve._private.common.ReplicaState``) of a replica
# that takes no new calls.
STOPPING_STATES = frozenset({"STOPPING", "STOPPED"})


async def watch_statuses(
    probe: Callable[[], Awaitable[tuple[int, str]]],
    stopping: Callable[[], Awaitable[bool]],
    period_s: float = WATCH_REFRESH_S,
) -> AsyncIterator[int]:
    """The statuses a ``Watch`` stream sends: ``probe()`` now and every ``period_s``
    seconds, yielded when it differs from the last one yielded (the first always).

    Args:
        probe: One health check: ``(status, why)``, the ``HealthCheckResponse``
            status number and, when the check itself failed, why (logged).
        stopping: Whether the stream must end (asked before each probe).
        period_s: Seconds between two probes.

    Returns once ``stopping()`` is true; the caller ends the call.
    """
    last: int | None = None
    while not await stopping():
        status, why = await probe()
        if status != last:
            if why:
                logger.warning("health Watch: the check failed ({}), status {}", why, status)
            last = status
            yield status
        await asyncio.sleep(period_s)


def replica_stopping(app_name: str, deployment: str, replica_id: str) -> bool:
    """Whether Ray Serve lists replica ``replica_id`` (its unique id) of ``deployment``
    in ``app_name`` as stopping, or no longer lists it (the application is deleted, or
    the replica is gone). Blocking: one call to Serve's controller.

    NOTE: Ray Serve tells a replica nothing when its drain begins (the replica's own
    ``_shutting_down`` is private). The replica states are those of Serve's public
    ``ServeInstanceDetails`` schema (``serve status``, the dashboard's
    ``/api/serve/applications/``); the client call that reads them is Serve's own.
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None, "raises rather than answer None when no controller runs"
    details = client.get_serve_details()
    application = details.get("applications", {}).get(app_name)
    if application is None:
        return True
    replicas = application.get("deployments", {}).get(deployment, {}).get("replicas", [])
    for replica in replicas:
        if replica["replica_id"] == replica_id:
            return str(getattr(replica["state"], "value", replica["state"])) in STOPPING_STATES
    return True


class StopSign:
    """Whether Ray Serve is stopping this replica (:func:`replica_stopping`), asked
    at most once every ``period_s`` seconds however many streams ask.

    Args:
        app_name: The Serve application's name.
        deployment: The replica's deployment (``Ingress``).
        replica_id: The replica's unique id (``serve.get_replica_context()``).
        period_s: Seconds an answer is kept.
    """

    def __init__(
        self, app_name: str, deployment: str, replica_id: str, period_s: float = WATCH_REFRESH_S
    ) -> None:
        self.app_name, self.deployment, self.replica_id = app_name, deployment, replica_id
        self.period_s = period_s
        self._asked_at = -math.inf
        self._stopping = False
        self._lock = asyncio.Lock()

    async def stopping(self) -> bool:
        """The latest answer, asked again when older than ``period_s``; a failed ask
        (Serve's controller restarting) keeps the last answer."""
        async with self._lock:
            if time.monotonic() - self._asked_at >= self.period_s:
                self._asked_at = time.monotonic()
                try:
                    self._stopping = await asyncio.to_thread(
                        replica_stopping, self.app_name, self.deployment, self.replica_id
                    )
                except Exception as error:
                    logger.warning("could not read this ingress's replica state: {!r}", error)
        return self._stopping
