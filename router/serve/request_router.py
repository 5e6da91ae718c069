"""Our Ray Serve ``RequestRouter``: routes the ingress's calls to replicas with
:class:`~router.serve.affinity.ReplicaChooser` (prefix-cache affinity and load, or
round-robin / least-loaded by ``--routing``).

Ray Serve asks :meth:`ShardserveRequestRouter.choose_replicas` for ranked candidates,
probes the first rank's queue length and sends the call to a replica of the first rank
that accepts it (below ``max_ongoing_requests``).
Each call's :class:`~router.serve.affinity.RouteHint` travels as its ``route`` keyword
argument; replicas' loads come from their ``record_routing_stats`` (pushed by Ray
Serve's controller every period) and from our own count of calls in flight.

The decision counts of this process are kept in
:data:`router.serve.affinity.ROUTING_DECISIONS` (and the passed-over and expected-hit
counters beside it) for the ingress's ``/metrics``. NOTE:
Ray Serve pickles this module by value into each process that routes (its globals are
copies there), so shared state is reached through another module, imported by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from router.serve import affinity
from router.serve.affinity import Decision, ReplicaChooser, RouteHint


def replica_key(replica_id: ReplicaID) -> str:
    """The id a replica is known by in the chooser, the board and ``/metrics``."""
    return str(replica_id.unique_id)


def _hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    route = pending_request.kwargs.get("route")
    return route if isinstance(route, RouteHint) else None


def _book(decision: Decision) -> None:
    """Count a call's first decision in this process's routing counters (a call asked
    again after a back-off is counted once)."""
    reasons = affinity.ROUTING_DECISIONS
    reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
    if decision.passed_over is not None:
        passed = affinity.ROUTING_PASSED_OVER
        passed[decision.passed_over] = passed.get(decision.passed_over, 0) + 1
    expected = affinity.ROUTING_EXPECTED_HIT_BLOCKS
    expected[decision.replica] = expected.get(decision.replica, 0) + decision.cached_blocks


class ShardserveRequestRouter(RequestRouter):
    """Ray Serve request router over :class:`ReplicaChooser` (exact request matching,
    no FIFO reordering: a replica chosen for a call's prefix serves that call)."""

    # NOTE: a probe that misses its deadline drops the replica from this round; on a
    # loaded CPU host Ray Serve's default (0.1 s) is missed often, which sent calls away
    # from the replica holding their prefix.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(self, policy: str = "affinity", max_gap: int = 4, **kwargs: Any) -> None:
        """Called by Ray Serve with ``request_router_kwargs``: the policy (``--routing``)
        and the load band of affinity (``--affinity-max-gap``, requests)."""
        self.chooser = ReplicaChooser(policy=policy, max_gap=max_gap)
        self._reasons: dict[str, str] = {}  # call in flight → why its replica was chosen

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve's new replica set: the chooser forgets gone replicas' blocks."""
        super().update_replicas(replicas)
        self.chooser.set_replicas(replica_key(r.replica_id) for r in replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """[[the chosen replica]]: no fall-back rank. Ray Serve sends the call there once
        the replica answers its queue-length probe below ``max_ongoing_requests``, else
        asks again after a back-off (and we choose again, on fresher loads)."""
        if not candidate_replicas:
            return []
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        for key, replica in by_key.items():
            if replica.routing_stats:
                self.chooser.report(key, replica.routing_stats)
        hint = _hint(pending_request)
        decision = self.chooser.choose(sorted(by_key), hint)
        if pending_request is not None:
            # NOTE: Ray Serve tells on_request_routed only under its strict
            # max_ongoing_requests mode; the first rank's replica takes the call unless
            # it is full (max_ongoing_requests = --max-concurrent-requests), so the
            # call is booked here, and moved if on_request_routed names another.
            request_id = pending_request.metadata.internal_request_id
            if request_id not in self._reasons:
                _book(decision)
            self._reasons[request_id] = decision.reason
            self.chooser.routed(decision.replica, hint, request_id)
        return [[by_key[decision.replica]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.chooser.routed(replica_key(replica_id), _hint(pending_request), request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._reasons.pop(internal_request_id, None)
        self.chooser.completed(internal_request_id)
