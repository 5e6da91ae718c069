"""The per-token histogram exposes what ``prometheus_client.Histogram`` would for the
same observations (bucket edges included: ``le`` counts values less than or equal)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from router.metrics import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1)
VALUES = [0.0, 0.001, 0.0011, 0.0025, 0.004, 0.01, 0.05, 0.1, 0.2, 7.0, 0.003]


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in registry.collect() for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_same_exposition_as_prometheus_histogram() -> None:
    ours, reference = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("itl_seconds", "help", BUCKETS)
    ours.register(fast)
    slow = Histogram("itl_seconds", "help", buckets=BUCKETS, registry=reference)
    for value in VALUES:
        fast.observe(value)
        slow.observe(value)
    assert samples(ours) == samples(reference)
    assert samples(ours)[("itl_seconds_bucket", "0.0025")] == 4  # 0, 0.001, 0.0011, 0.0025
