"""Prometheus metrics of the router, all named ``shardserve_*``.

One :class:`Metrics` per engine, on its own registry (so several engines can live in
one process, as in tests). Gauges that mirror scheduler state (queue, batch, KV blocks)
and the prefix-cache counter are read at scrape time by a collector.

Counters and histograms are this module's own (:class:`LoopCounter`,
:class:`LoopHistogram`): changed on the event loop only, an observation is an addition
or two where ``prometheus_client``'s take a lock, and each counts its changes, so that
:meth:`Metrics.render` renders again only when something changed (a flood of scrapes
costs one rendering per engine step at most, not one each). Each also writes its own
lines of the text exposition, the same bytes ``prometheus_client.generate_latest``
writes for the registry, in a tenth of its time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "shardserve"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 30.0, 60.0, 120.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# name → help; the README lists the same names.
METRIC_NAMES = {
    f"{PREFIX}_requests_total": "Finished requests by outcome",
    f"{PREFIX}_queue_size": "Requests waiting for admission",
    f"{PREFIX}_running_batch_size": "Requests in the running (decode) batch",
    f"{PREFIX}_time_to_first_token_seconds": "Time from arrival to the first token",
    f"{PREFIX}_inter_token_latency_seconds": "Time between consecutive tokens of a request",
    f"{PREFIX}_e2e_request_latency_seconds": "Time from arrival to the last token",
    f"{PREFIX}_queue_time_seconds": "Time from arrival to admission",
    f"{PREFIX}_prompt_tokens_total": "Prompt tokens of admitted requests",
    f"{PREFIX}_generation_tokens_total": "Generated tokens",
    f"{PREFIX}_prefill_step_duration_seconds": "Shard forward time of a prefill step",
    f"{PREFIX}_decode_step_duration_seconds": "Shard forward time of a decode step",
    f"{PREFIX}_decode_step_wall_seconds": (
        "Decode step period seen by the router: time between two decode results with no "
        "prefill between them (all ranks)"),
    f"{PREFIX}_spec_decode_proposed_tokens_total": (
        "Guesses proposed for speculative decoding (verified by the target)"),
    f"{PREFIX}_spec_decode_accepted_tokens_total": (
        "Guesses accepted by speculative decoding (acceptance rate = accepted / proposed)"),
    f"{PREFIX}_spec_decode_verifications_total": (
        "Requests' verify steps with at least one guess (mean accepted length = "
        "accepted / verifications)"),
    f"{PREFIX}_spec_decode_verify_step_duration_seconds": (
        "Shard time of a speculative decode step's verify forward and sampling"),
    f"{PREFIX}_spec_decode_propose_step_duration_seconds": (
        "Shard time of a speculative decode step's guesses (a draft model's steps; "
        "n-gram lookups)"),
    f"{PREFIX}_kv_blocks_total": "KV cache blocks",
    f"{PREFIX}_kv_blocks_used": "KV cache blocks owned by requests",
    f"{PREFIX}_prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache",
}


def _header(name: str, documentation: str, kind: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a metric (``name`` as exposed)."""
    escaped = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


class _StateCollector(Collector):
    """Reads gauges and the prefix-cache counter from the engine at scrape time."""

    GAUGES = ("queue_size", "running_batch_size", "kv_blocks_total", "kv_blocks_used")

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read
        self._headers = {
            name: _header(f"{PREFIX}_{name}", METRIC_NAMES[f"{PREFIX}_{name}"], "gauge")
            for name in self.GAUGES
        }
        hits = f"{PREFIX}_prefix_cache_hit_tokens_total"
        self._hits_header = _header(hits, METRIC_NAMES[hits], "counter")

    def collect(self) -> Iterator[Metric]:
        state = self._read()
        for name in self.GAUGES:
            full = f"{PREFIX}_{name}"
            yield GaugeMetricFamily(full, METRIC_NAMES[full], value=state[name])
        full = f"{PREFIX}_prefix_cache_hit_tokens"
        yield CounterMetricFamily(
            full, METRIC_NAMES[full + "_total"], value=state["prefix_cache_hit_tokens"]
        )

    def expose(self, lines: list[str], state: dict[str, float]) -> None:
        """Append the exposition of ``state`` (what ``read`` returned) to ``lines``."""
        for name in self.GAUGES:
            lines.append(f"{self._headers[name]}{PREFIX}_{name} "
                         f"{floatToGoString(state[name])}\n")
        lines.append(f"{self._hits_header}{PREFIX}_prefix_cache_hit_tokens_total "
                     f"{floatToGoString(state['prefix_cache_hit_tokens'])}\n")


class LoopCounter(Collector):
    """A counter, optionally split by the values of one label; changed on the event loop
    only (no lock).

    Args:
        name: Full metric name, ending in ``_total``.
        documentation: Help text.
        label: The label's name (``outcome``), or None for a counter without labels.

    Attributes:
        changes: How many times it changed (the render cache's key).
    """

    def __init__(self, name: str, documentation: str, label: str | None = None) -> None:
        assert name.endswith("_total"), f"a counter's name ends in _total: {name}"
        self.name = name
        self.documentation = documentation
        self.label = label
        self.changes = 0
        self._values: dict[str, float] = {} if label else {"": 0.0}
        self._children: dict[str, _CounterChild] = {}
        self._header = _header(name, documentation, "counter")

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0) to the counter without labels."""
        assert self.label is None, f"{self.name} is counted by {self.label}: use labels()"
        self._values[""] += amount
        self.changes += 1

    def labels(self, value: str) -> _CounterChild:
        """The counter of one value of the label (a plain word; created at 0)."""
        child = self._children.get(value)
        if child is None:
            assert self.label is not None, f"{self.name} has no label"
            assert value.isidentifier(), f"label values are plain words: {value!r}"
            self._values[value] = 0.0
            child = self._children[value] = _CounterChild(self, value)
        return child

    def _add(self, value: str, amount: float) -> None:
        self._values[value] += amount
        self.changes += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation,
                                     labels=[self.label] if self.label else None)
        for value, count in self._values.items():
            family.add_metric([value] if self.label else [], count)
        yield family

    def expose(self, lines: list[str]) -> None:
        """Append this counter's exposition to ``lines``."""
        lines.append(self._header)
        for value, count in self._values.items():
            labels = f'{{{self.label}="{value}"}}' if self.label else ""
            lines.append(f"{self.name}{labels} {floatToGoString(count)}\n")


class _CounterChild:
    """One label value's counter of a :class:`LoopCounter`."""

    __slots__ = ("_counter", "_value")

    def __init__(self, counter: LoopCounter, value: str) -> None:
        self._counter = counter
        self._value = value

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0)."""
        self._counter._add(self._value, amount)


class LoopHistogram(Collector):
    """A histogram changed on the event loop only (observed up to once per generated
    token).

    ``prometheus_client.Histogram.observe`` takes a lock and costs about 5 µs; with 256
    sequences that is more than a millisecond of every decode step. Here an observation
    is a bisection and two additions; the exposition is the same (cumulative ``_bucket``
    series with ``le`` labels, ``_count`` and ``_sum``).

    Args:
        name: Full metric name (without ``_bucket``/``_count``/``_sum``).
        documentation: Help text.
        buckets: Upper bounds in seconds, increasing (``+Inf`` is added).

    Attributes:
        changes: How many observations it has had (the render cache's key).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._upper = [*buckets, math.inf]
        self._counts = [0] * len(self._upper)
        self._sum = 0.0
        self.changes = 0
        self._header = _header(name, documentation, "histogram")
        self._bucket_names = [f'{name}_bucket{{le="{floatToGoString(upper)}"}} '
                              for upper in self._upper]

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (seconds)."""
        self._counts[bisect.bisect_left(self._upper, value)] += 1
        self._sum += value
        self.changes += 1

    def collect(self) -> Iterator[Metric]:
        cumulative, total = [], 0
        for upper, count in zip(self._upper, self._counts, strict=True):
            total += count
            cumulative.append((floatToGoString(upper), total))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                    sum_value=self._sum)

    def expose(self, lines: list[str]) -> None:
        """Append this histogram's exposition to ``lines``."""
        lines.append(self._header)
        total = 0
        for bucket, count in zip(self._bucket_names, self._counts, strict=True):
            total += count
            lines.append(f"{bucket}{floatToGoString(total)}\n")
        lines.append(f"{self.name}_count {floatToGoString(total)}\n"
                     f"{self.name}_sum {floatToGoString(self._sum)}\n")


# one of this module's own metric types, as registered
_Own = TypeVar("_Own", LoopCounter, LoopHistogram)


class Metrics:
    """The router's metrics on a private registry. Change them on the event loop only.

    Args:
        read_state: Returns the current ``queue_size``, ``running_batch_size``,
            ``kv_blocks_total``, ``kv_blocks_used`` and ``prefix_cache_hit_tokens``.
    """

    def __init__(self, read_state: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self._read_state = read_state
        self._own: list[LoopCounter | LoopHistogram] = []

        def histogram(name: str, buckets: tuple[float, ...]) -> LoopHistogram:
            full = f"{PREFIX}_{name}"
            return own(LoopHistogram(full, METRIC_NAMES[full], buckets))

        def counter(name: str, label: str | None = None) -> LoopCounter:
            full = f"{PREFIX}_{name}_total"
            return own(LoopCounter(full, METRIC_NAMES[full], label))

        def own(metric: _Own) -> _Own:
            self.registry.register(metric)
            self._own.append(metric)
            return metric

        self.requests = counter("requests", "outcome")
        self.prompt_tokens = counter("prompt_tokens")
        self.generation_tokens = counter("generation_tokens")
        self.time_to_first_token = histogram("time_to_first_token_seconds", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", _STEP_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", _LATENCY_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", _LATENCY_BUCKETS)
        self.prefill_step = histogram("prefill_step_duration_seconds", _STEP_BUCKETS)
        self.decode_step = histogram("decode_step_duration_seconds", _STEP_BUCKETS)
        self.decode_step_wall = histogram("decode_step_wall_seconds", _STEP_BUCKETS)
        self.proposed_tokens = counter("spec_decode_proposed_tokens")
        self.accepted_tokens = counter("spec_decode_accepted_tokens")
        self.verifications = counter("spec_decode_verifications")
        self.verify_step = histogram("spec_decode_verify_step_duration_seconds",
                                     _STEP_BUCKETS)
        self.propose_step = histogram("spec_decode_propose_step_duration_seconds",
                                      _STEP_BUCKETS)
        self._state = _StateCollector(read_state)
        self.registry.register(self._state)
        self._rendered: tuple[tuple[float, ...], bytes] | None = None

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (what ``generate_latest``
        writes for :attr:`registry`).

        Rendered again only when a metric or the engine's state changed since the last
        rendering; otherwise the same bytes are returned (exact, never stale)."""
        state = self._read_state()
        key = (*(metric.changes for metric in self._own), *state.values())
        if self._rendered is None or self._rendered[0] != key:
            lines: list[str] = []
            for metric in self._own:
                metric.expose(lines)
            self._state.expose(lines, state)
            self._rendered = (key, "".join(lines).encode())
        return self._rendered[1]
