"""Choosing the replica of a request: prefix-cache affinity balanced against load.

A replica's prefix cache indexes every full prompt block by a digest chained over all
tokens up to that block (:func:`router.block_manager.block_hashes`). The request router
computes the same digests for each prompt (same tokenizer, chat template and block
size as the replicas) and remembers which replica it sent each block chain to
(:class:`PrefixIndex`). A new request goes to the replica holding the longest run of
its leading blocks, among the replicas whose load is within ``max_gap`` ongoing
requests of the least loaded one; with no cached run in that band, to the least loaded.
A request naming a conversation stays on the conversation's replica while that one is
within the band. This is the scheme of SGLang's cache-aware router and of Ray Serve
LLM's ``PrefixCacheAffinityRouter`` (prefix match first, load threshold second), on
exact block digests instead of characters.

The index forgets as the replicas do: each replica's entries are an LRU list bounded by
the KV blocks it reports, refreshed head-last so that a chain's tail is forgotten
before its head (the block manager frees a sequence's blocks last to first).

Nothing here imports Ray: :mod:`router.serve.request_router` adapts it to Ray Serve's
``RequestRouter``, and ``benchmarks/simulations/replica_routing.py`` drives it alone.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# A replica whose KV cache is at least this full counts as out of the load band.
KV_FULL = 0.95
# Blocks a replica's index keeps before it has reported its KV capacity.
DEFAULT_REPLICA_BLOCKS = 4096
# Seconds a replica's load report may lag behind it: two periods of its push
# (ROUTING_STATS_PERIOD_S, router/serve/app.py).
REPORT_STALENESS_S = 1.0
# Conversations remembered (LRU) for stickiness.
MAX_CONVERSATIONS = 100_000
# What the request routers of this process decided (the ingress's /metrics shows it;
# see router/serve/request_router.py): calls by decision reason; calls sent away from
# the replica holding their longest cached run, by why (``Decision.passed_over``); and
# per replica the prompt blocks the index expected it to hold (to compare with the
# replica's own prefix-cache hit counter).
ROUTING_DECISIONS: dict[str, int] = {}
ROUTING_PASSED_OVER: dict[str, int] = {}
ROUTING_EXPECTED_HIT_BLOCKS: dict[str, int] = {}


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of a request before choosing its replica.

    Attributes:
        block_hashes: Chained digests of the prompt's full blocks, in order (bytes
            each, :func:`~router.block_manager.block_hashes`); empty when unknown.
        conversation: The conversation the request names (a header or OpenAI's
            ``user``), or None.
    """

    block_hashes: tuple[bytes, ...] = ()
    conversation: str | None = None


@dataclass
class ReplicaLoad:
    """One replica's load as the router sees it.

    Attributes:
        in_flight: Requests this router sent it and that have not finished.
        reported_ongoing: Waiting + running requests it last reported (every router's).
        kv_used: Fraction of its KV blocks owned by requests, last reported (0-1).
        kv_blocks: KV blocks it holds (0 = not reported yet).
        completed_at: When (clock seconds) this router's requests on it finished, for
            the last ``REPORT_STALENESS_S``.
    """

    in_flight: int = 0
    reported_ongoing: int = 0
    kv_used: float = 0.0
    kv_blocks: int = 0
    completed_at: deque[float] = field(default_factory=deque)

    def ongoing(self, now: float) -> int:
        """Requests it is serving at ``now``: the larger of our count and its report
        (ours is current; its report covers other routers' requests but is up to
        ``REPORT_STALENESS_S`` old, so our requests that finished since are taken out
        of it: a chat's next turn follows its last one at once, and would otherwise see
        its own replica one request busier than it is)."""
        while self.completed_at and self.completed_at[0] < now - REPORT_STALENESS_S:
            self.completed_at.popleft()
        return max(self.in_flight, self.reported_ongoing - len(self.completed_at))


class PrefixIndex:
    """Which replicas hold which prompt blocks: digest → replicas, and one LRU list of
    digests per replica bounded by its KV blocks.

    Args:
        default_capacity: Blocks kept for a replica whose capacity is not known yet.
    """

    def __init__(self, default_capacity: int = DEFAULT_REPLICA_BLOCKS) -> None:
        self.default_capacity = default_capacity
        self._holders: dict[bytes, set[str]] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}

    def __len__(self) -> int:
        """Digests indexed (any replica)."""
        return len(self._holders)

    def blocks_of(self, replica: str) -> int:
        """Digests indexed for ``replica``."""
        return len(self._lru.get(replica, ()))

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound ``replica``'s entries to ``blocks`` (its KV cache), evicting LRU ones."""
        self._capacity[replica] = max(1, blocks)
        self._evict(replica)

    def insert(self, replica: str, hashes: Sequence[bytes]) -> None:
        """Record that ``replica`` now holds the chain ``hashes`` (most recently used:
        the head last, so that the tail is evicted first, as the replica does)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for digest in reversed(hashes):
            if digest in lru:
                lru.move_to_end(digest)
            else:
                lru[digest] = None
                self._holders.setdefault(digest, set()).add(replica)
        self._evict(replica)

    def _evict(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        capacity = self._capacity.get(replica, self.default_capacity)
        while len(lru) > capacity:
            digest, _ = lru.popitem(last=False)
            self._drop_holder(digest, replica)

    def _drop_holder(self, digest: bytes, replica: str) -> None:
        holders = self._holders[digest]
        holders.discard(replica)
        if not holders:
            del self._holders[digest]

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Replica → leading blocks of ``hashes`` it holds (only replicas holding at
        least the first). Cost: one lookup per block until no holder is left."""
        depth: dict[str, int] = {}
        alive: set[str] = set()
        for position, digest in enumerate(hashes):
            holders = self._holders.get(digest, set())
            alive = set(holders) if position == 0 else alive & holders
            for replica in alive:
                depth[replica] = position + 1
            if not alive:
                break
        return depth

    def remove_replica(self, replica: str) -> None:
        """Forget everything ``replica`` held (it is gone)."""
        for digest in self._lru.pop(replica, {}):
            self._drop_holder(digest, replica)
        self._capacity.pop(replica, None)


@dataclass(frozen=True)
class Decision:
    """A chosen replica and why.

    Attributes:
        replica: The chosen replica.
        reason: ``prefix`` (holds the longest cached run within the load band),
            ``conversation`` (the conversation's replica), ``least_loaded`` (nothing
            cached in the band, or the policy), ``round_robin`` (the policy).
        cached_blocks: Leading prompt blocks the index says the chosen replica holds.
        passed_over: Why the replica holding the longest cached run was not chosen:
            ``load`` (out of the load band), ``kv_full`` (its KV cache is full),
            ``conversation`` (the conversation's replica came first), ``policy``
            (round-robin / least-loaded ignore the cache); None when it was chosen or
            nothing is cached.
    """

    replica: str
    reason: str
    cached_blocks: int = 0
    passed_over: str | None = None


@dataclass
class ReplicaChooser:
    """The routing policy over a changing set of replicas (ids are strings).

    Args:
        policy: ``affinity``, ``round_robin`` or ``least_loaded``.
        max_gap: The load band: replicas with at most the least loaded one's ongoing
            requests + ``max_gap`` may be chosen for affinity (requests).
        index: The prefix index (a fresh one by default).
        clock: Seconds, monotonic (how old a load report may be is judged by it).
    """

    policy: str = "affinity"
    max_gap: int = 4
    index: PrefixIndex = field(default_factory=PrefixIndex)
    clock: Callable[[], float] = time.monotonic
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    passed_over: dict[str, int] = field(default_factory=dict)
    _conversations: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _requests: dict[str, str] = field(default_factory=dict)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The replicas now serving: new ones start empty, gone ones are forgotten."""
        current = set(replicas)
        for gone in set(self.loads) - current:
            del self.loads[gone]
            self.index.remove_replica(gone)
        for replica in current:
            self.loads.setdefault(replica, ReplicaLoad())

    def report(self, replica: str, stats: Mapping[str, float]) -> None:
        """Take a replica's reported ``queue_size``, ``running``, ``kv_blocks_total``
        and ``kv_blocks_used`` (missing keys are left as they were)."""
        load = self.loads.setdefault(replica, ReplicaLoad())
        if "queue_size" in stats and "running" in stats:
            load.reported_ongoing = int(stats["queue_size"]) + int(stats["running"])
        total = int(stats.get("kv_blocks_total", 0))
        if total > 0:
            load.kv_used = float(stats.get("kv_blocks_used", 0)) / total
            if total != load.kv_blocks:
                load.kv_blocks = total
                self.index.set_capacity(replica, total)

    def _effective(self, replica: str) -> int:
        """Ongoing requests, plus a band's width when the KV cache is full (such a
        replica would queue the request)."""
        load = self.loads.get(replica) or ReplicaLoad()
        return load.ongoing(self.clock()) + (self.max_gap + 1 if load.kv_used >= KV_FULL else 0)

    def _least_loaded(self, candidates: Sequence[str]) -> str:
        """The least loaded candidate; ties rotate (so an idle set is served in turn)."""
        start = next(self._turn) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=self._effective)

    def choose(self, candidates: Sequence[str], hint: RouteHint | None = None) -> Decision:
        """The replica among ``candidates`` (non-empty) for a request with ``hint``.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        if not candidates:
            raise ValueError("no replica to choose from")
        depth: dict[str, int] = {}
        if hint is not None and hint.block_hashes:
            matched = self.index.match(hint.block_hashes)
            depth = {r: matched[r] for r in candidates if r in matched}
        if self.policy == "round_robin":
            turn = candidates[next(self._turn) % len(candidates)]
            return self._decided(turn, "round_robin", depth)
        least = self._least_loaded(candidates)
        if self.policy == "least_loaded" or hint is None:
            return self._decided(least, "least_loaded", depth)
        ceiling = self._effective(least) + self.max_gap
        sticky = self._conversations.get(hint.conversation) if hint.conversation else None
        if sticky is not None and sticky in candidates and self._effective(sticky) <= ceiling:
            return self._decided(sticky, "conversation", depth)
        band = [r for r in candidates if depth.get(r, 0) and self._effective(r) <= ceiling]
        if not band:
            return self._decided(least, "least_loaded", depth)
        best = max(band, key=lambda r: (depth[r], -self._effective(r)))
        return self._decided(best, "prefix", depth)

    def _decided(self, replica: str, reason: str, depth: Mapping[str, int]) -> Decision:
        """The decision for ``replica``, with why the deepest holder in ``depth`` (replica
        → cached leading blocks) was passed over, counted in ``decisions`` and
        ``passed_over``."""
        passed_over = None
        deepest = max(depth.values(), default=0)
        if deepest > depth.get(replica, 0):
            holder = next(r for r, blocks in depth.items() if blocks == deepest)
            if self.policy != "affinity":
                passed_over = "policy"
            elif reason == "conversation":
                passed_over = "conversation"
            elif self.loads.get(holder, ReplicaLoad()).kv_used >= KV_FULL:
                passed_over = "kv_full"
            else:
                passed_over = "load"
            self.passed_over[passed_over] = self.passed_over.get(passed_over, 0) + 1
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        return Decision(replica, reason, depth.get(replica, 0), passed_over)

    def routed(self, replica: str, hint: RouteHint | None, request_id: str) -> None:
        """``request_id`` went to ``replica``: count it in flight, index its prompt
        blocks there, and tie its conversation to the replica. Telling it again moves
        the request (counted once, on the replica named last)."""
        before = self._requests.get(request_id)
        if before != replica:
            if before is not None and before in self.loads:
                self.loads[before].in_flight -= 1
            self.loads.setdefault(replica, ReplicaLoad()).in_flight += 1
            self._requests[request_id] = replica
        if hint is None:
            return
        if hint.block_hashes:
            self.index.insert(replica, hint.block_hashes)
        if hint.conversation:
            self._conversations[hint.conversation] = replica
            self._conversations.move_to_end(hint.conversation)
            while len(self._conversations) > MAX_CONVERSATIONS:
                self._conversations.popitem(last=False)

    def completed(self, request_id: str) -> None:
        """``request_id`` finished (or failed): no longer in flight."""
        replica = self._requests.pop(request_id, None)
        load = self.loads.get(replica) if replica is not None else None
        if load is not None and load.in_flight > 0:
            load.in_flight -= 1
            load.completed_at.append(self.clock())
