"""``Metrics.render``: the bytes ``prometheus_client.generate_latest`` writes for the same
registry, rendered again only when something changed (a flood of scrapes reuses one
rendering), and never stale."""

from __future__ import annotations

from prometheus_client import generate_latest

from router.metrics import Metrics


def state(**changes: float) -> dict[str, float]:
    return {"queue_size": 1, "running_batch_size": 2, "kv_blocks_total": 100,
            "kv_blocks_used": 3, "prefix_cache_hit_tokens": 5, **changes}


def observed(metrics: Metrics) -> None:
    """One change of every kind."""
    metrics.requests.labels("success").inc()
    metrics.requests.labels("rejected").inc(2)
    metrics.prompt_tokens.inc(7)
    metrics.generation_tokens.inc(3)
    for value in (0.0, 0.001, 0.0025, 0.3, 9.0, 200.0):
        metrics.time_to_first_token.observe(value)
        metrics.inter_token_latency.observe(value)
        metrics.decode_step_wall.observe(value)


def test_render_is_the_registry_exposition() -> None:
    metrics = Metrics(state)
    assert metrics.render() == generate_latest(metrics.registry)
    observed(metrics)
    text = metrics.render()
    assert text == generate_latest(metrics.registry)
    assert b'shardserve_requests_total{outcome="rejected"} 2.0\n' in text
    assert b'shardserve_inter_token_latency_seconds_bucket{le="0.0025"} 3.0\n' in text
    assert b"shardserve_kv_blocks_used 3.0\n" in text


def test_a_scrape_with_nothing_changed_reuses_the_last_rendering() -> None:
    current = state()
    metrics = Metrics(lambda: current)
    observed(metrics)
    first = metrics.render()
    assert metrics.render() is first  # not rendered again

    metrics.generation_tokens.inc()  # a metric changed: rendered again, exactly
    second = metrics.render()
    assert b"shardserve_generation_tokens_total 4.0\n" in second
    assert metrics.render() is second

    current = state(queue_size=9)  # the engine's state changed
    assert b"shardserve_queue_size 9.0\n" in metrics.render()
    metrics.requests.labels("error").inc()
    assert b'shardserve_requests_total{outcome="error"} 1.0\n' in metrics.render()
    metrics.e2e_latency.observe(0.5)
    assert b"shardserve_e2e_request_latency_seconds_count 1.0\n" in metrics.render()
    assert metrics.render() == generate_latest(metrics.registry)
