"""Operating the server: Prometheus metrics, JSON logs, graceful SIGTERM shutdown.

Uses its own server (local executor, JSON logs) so request counters are exact.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import METRIC_NAMES
from tests.e2e.conftest import SMALL_BUDGETS, launch, stop

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def local_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object, Path]]:
    log_path = tmp_path_factory.mktemp("ops") / "server.log"
    base_url, process = launch(
        ["--executor", "local", "--json-output", "--graceful-timeout", "60", *SMALL_BUDGETS],
        log_path,
    )
    yield base_url, process, log_path
    stop(process)


def scrape(base_url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    assert response.status_code == 200
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = (
                sample.value
            )
    return samples


def total(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


def test_metrics_are_consistent_with_requests_sent(local_server: tuple[str, object, Path]) -> None:
    base_url = local_server[0]
    prompt = "Count to ten: one, two, three, four, five, six, seven, eight,"
    sent, generated = 4, 0
    for _ in range(sent):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 6, "details": True}}
        response = httpx.post(f"{base_url}/generate", json=body, timeout=120)
        assert response.status_code == 200
        generated += response.json()["details"]["generated_tokens"]
    samples = scrape(base_url)
    for name in METRIC_NAMES:
        base = name.removesuffix("_total")
        assert any(key.startswith(base) for key in samples), f"{name} missing"
    assert samples["shardserve_requests_total"][(("outcome", "success"),)] == sent
    assert total(samples, "shardserve_generation_tokens_total") == generated
    assert total(samples, "shardserve_time_to_first_token_seconds_count") == sent
    assert total(samples, "shardserve_e2e_request_latency_seconds_count") == sent
    assert total(samples, "shardserve_queue_time_seconds_count") == sent
    assert total(samples, "shardserve_inter_token_latency_seconds_count") == generated - sent
    assert total(samples, "shardserve_prefill_step_duration_seconds_count") >= 1
    info = httpx.get(f"{base_url}/info", timeout=30).json()
    assert total(samples, "shardserve_kv_blocks_total") == info["kv_blocks_total"]
    assert total(samples, "shardserve_kv_blocks_used") == 0 == info["kv_blocks_used"]
    assert total(samples, "shardserve_queue_size") == 0
    # The same prompt three more times: its full blocks come from the prefix cache.
    hits = total(samples, "shardserve_prefix_cache_hit_tokens_total")
    assert hits >= 16 * (sent - 1)
    assert info["prefix_cache_hit_tokens"] == hits


def test_finished_requests_log_one_json_line(local_server: tuple[str, object, Path]) -> None:
    base_url, _, log_path = local_server
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 3}}
    assert httpx.post(f"{base_url}/generate", json=body, timeout=120).status_code == 200
    records = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line)["record"])
    finished = [r for r in records if "request_id" in r["extra"]]
    assert finished, "no per-request log line"
    last = finished[-1]
    assert "generated_tokens=3" in last["message"] and "finish_reason=length" in last["message"]
    shard_lines = [r for r in records if r["extra"].get("rank") == 0]
    assert any("listening on" in r["message"] for r in shard_lines), "no JSON shard line"


def test_sigterm_lets_a_stream_finish_then_exits_zero(
    local_server: tuple[str, object, Path],
) -> None:
    base_url, process, _ = local_server
    body = {"inputs": "Write a long story about a dragon.",
            "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
    events: list[dict[str, object]] = []
    sent_signal = threading.Event()
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(json.loads(line[len("data:") :]))
            if len(events) == 2:
                process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
                sent_signal.set()
    assert sent_signal.is_set()
    assert len(events) == 40
    assert events[-1]["details"]["finish_reason"] == "length"  # type: ignore[index]
    assert process.wait(timeout=120) == 0  # type: ignore[attr-defined]
