"""Prometheus metrics of the router, all named ``shardserve_*``.

One :class:`Metrics` per engine, on its own registry (so several engines can live in
one process, as in tests). Gauges that mirror scheduler state (queue, batch, KV blocks)
and the prefix-cache counter are read at scrape time by a collector.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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
    f"{PREFIX}_kv_blocks_total": "KV cache blocks",
    f"{PREFIX}_kv_blocks_used": "KV cache blocks owned by requests",
    f"{PREFIX}_prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache",
}


class _StateCollector(Collector):
    """Reads gauges and the prefix-cache counter from the engine at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        state = self._read()
        for name in ("queue_size", "running_batch_size", "kv_blocks_total", "kv_blocks_used"):
            full = f"{PREFIX}_{name}"
            yield GaugeMetricFamily(full, METRIC_NAMES[full], value=state[name])
        full = f"{PREFIX}_prefix_cache_hit_tokens"
        yield CounterMetricFamily(
            full, METRIC_NAMES[full + "_total"], value=state["prefix_cache_hit_tokens"]
        )


class TokenHistogram(Collector):
    """A histogram observed once per generated token, on the event loop only.

    ``prometheus_client.Histogram.observe`` takes a lock and costs about 5 µs; with 256
    sequences that is more than a millisecond of every decode step. Here an observation
    is a bisection and two additions; the exposition is the same (cumulative ``_bucket``
    series with ``le`` labels, ``_count`` and ``_sum``).

    Args:
        name: Full metric name (without ``_bucket``/``_count``/``_sum``).
        documentation: Help text.
        buckets: Upper bounds in seconds, increasing (``+Inf`` is added).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._upper = [*buckets, math.inf]
        self._counts = [0] * len(self._upper)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (seconds)."""
        self._counts[bisect.bisect_left(self._upper, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        cumulative, total = [], 0
        for upper, count in zip(self._upper, self._counts, strict=True):
            total += count
            cumulative.append((floatToGoString(upper), total))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                    sum_value=self._sum)


class Metrics:
    """The router's metrics on a private registry.

    Args:
        read_state: Returns the current ``queue_size``, ``running_batch_size``,
            ``kv_blocks_total``, ``kv_blocks_used`` and ``prefix_cache_hit_tokens``.
    """

    def __init__(self, read_state: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
            full = f"{PREFIX}_{name}"
            return Histogram(full, METRIC_NAMES[full], buckets=buckets, registry=r)

        def counter(name: str, labels: tuple[str, ...] = ()) -> Counter:
            full = f"{PREFIX}_{name}"
            return Counter(full, METRIC_NAMES[full + "_total"], labels, registry=r)

        self.requests = counter("requests", ("outcome",))
        self.prompt_tokens = counter("prompt_tokens")
        self.generation_tokens = counter("generation_tokens")
        self.time_to_first_token = histogram("time_to_first_token_seconds", _LATENCY_BUCKETS)
        itl = f"{PREFIX}_inter_token_latency_seconds"
        self.inter_token_latency = TokenHistogram(itl, METRIC_NAMES[itl], _STEP_BUCKETS)
        r.register(self.inter_token_latency)
        self.e2e_latency = histogram("e2e_request_latency_seconds", _LATENCY_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", _LATENCY_BUCKETS)
        self.prefill_step = histogram("prefill_step_duration_seconds", _STEP_BUCKETS)
        self.decode_step = histogram("decode_step_duration_seconds", _STEP_BUCKETS)
        self.decode_step_wall = histogram("decode_step_wall_seconds", _STEP_BUCKETS)
        r.register(_StateCollector(read_state))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
