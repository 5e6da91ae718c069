"""Hostile clients against the real server (tiny model with a 4096-token context, local
shard, default budgets): large inputs do not pause running streams, long prompts are
prefilled in chunks, and streaming clients that leave while queued free their place."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.tokenizer import Tokenizer
from tests.e2e.conftest import launch, stop

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Default budgets, two requests in the running batch at most."""
    log_path = tmp_path_factory.mktemp("hostile") / "server.log"
    base_url, process = launch(
        ["--model", str(tiny_long_model_dir), "--executor", "local", "--max-batch-size", "2",
         "--kv-cache-bytes", str(32 * 1024 * 1024)],
        log_path,
    )
    yield base_url
    stop(process)


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` (with ``labels``) on /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items())
    )


class Stream:
    """A long generation streamed in a thread; records when each event arrives."""

    def __init__(self, base_url: str, max_new_tokens: int = 3000) -> None:
        self.arrivals: list[float] = []
        self.finished = False
        self._stop = threading.Event()
        body = {"inputs": "Once upon a time",
                "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        self._thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self._thread.start()

    def _read(self, base_url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{base_url}/generate_stream", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.arrivals.append(time.monotonic())
                    last = json.loads(line[5:]).get("generated_text") is not None
                    if last or self._stop.is_set():
                        break
        self.finished = not self._stop.is_set()

    def wait_for(self, events: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.arrivals) < events:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def longest_gap(arrivals: list[float], start: float, end: float) -> float:
    """Longest time without an event between ``start`` and ``end`` (seconds)."""
    inside = [start, *[t for t in arrivals if start < t < end], end]
    return max(b - a for a, b in itertools.pairwise(inside))


def test_large_prompts_do_not_pause_running_streams(
    server: str, tiny_long_model_dir: Path
) -> None:
    text = "hello world, this is some text. " * 30_000  # 960,000 characters, under 1 MiB
    tokenizer = Tokenizer.from_folder(tiny_long_model_dir)
    started = time.perf_counter()
    tokenizer.backend.encode(text)
    tokenize_s = time.perf_counter() - started
    body = {"inputs": text, "parameters": {"truncate": 16, "max_new_tokens": 1}}
    stream = Stream(server)
    try:
        stream.wait_for(5)
        sent = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(
                lambda _: httpx.post(f"{server}/generate", json=body, timeout=120).status_code,
                range(3),
            ))
        done = time.monotonic()
        assert statuses == [200, 200, 200]
        # Three tokenizations of 1 MiB ran meanwhile; the stream never waited for one.
        gap = longest_gap(stream.arrivals, sent, done)
        assert gap < tokenize_s / 2, (gap, tokenize_s)
    finally:
        stream.close()


def test_default_budgets_prefill_a_long_prompt_in_chunks(server: str) -> None:
    info = httpx.get(f"{server}/info", timeout=30).json()
    assert info["max_input_tokens"] == 4095
    assert info["max_batch_prefill_tokens"] == 512  # the CPU default
    steps = metric(server, "shardserve_prefill_step_duration_seconds_count")
    body = {"inputs": "word " * 2000, "parameters": {"truncate": 1500, "max_new_tokens": 1}}
    response = httpx.post(f"{server}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    # 1500 prompt tokens: chunks of 512, 512 and 476 tokens.
    assert metric(server, "shardserve_prefill_step_duration_seconds_count") == steps + 3


QUEUED_STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 20}}),
    ("/", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 20}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 20, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                              "max_tokens": 20, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), QUEUED_STREAMS, ids=[p for p, _ in QUEUED_STREAMS])
def test_streaming_clients_that_leave_while_queued_are_cancelled(
    server: str, path: str, body: dict[str, Any]
) -> None:
    running = [Stream(server), Stream(server)]  # the whole running batch
    try:
        for stream in running:
            stream.wait_for(1)
        cancelled = metric(server, "shardserve_requests_total", {"outcome": "cancelled"})
        prefills = metric(server, "shardserve_prefill_step_duration_seconds_count")

        def leave() -> None:
            # Waits in the queue for its first token; gives up after 2 s.
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{server}{path}", json=body, timeout=2.0)

        with ThreadPoolExecutor(3) as pool:
            leaving = [pool.submit(leave) for _ in range(3)]
            deadline = time.monotonic() + 1.5
            while metric(server, "shardserve_queue_size") < 3:
                assert time.monotonic() < deadline, "the requests were not queued"
                time.sleep(0.05)
            for future in leaving:
                future.result()
        deadline = time.monotonic() + 3.0
        while metric(server, "shardserve_queue_size") > 0:
            assert time.monotonic() < deadline, "requests of gone clients stay queued"
            time.sleep(0.1)
        assert metric(server, "shardserve_requests_total", {"outcome": "cancelled"}) == (
            cancelled + 3
        )
        # Never prefilled, and the running streams were not disturbed.
        assert metric(server, "shardserve_prefill_step_duration_seconds_count") == prefills
        assert not any(stream.finished for stream in running)
    finally:
        for stream in running:
            stream.close()
