"""``shardserve serve`` autoscaled by Ray Serve on ongoing calls: one replica of the
default model (local Ray, CPU) grows to two under a sustained load of streams sent
through Serve's HTTP proxy, both serve it, and the application shrinks back to one once
the load ends, every call of the load and of the scale-down getting its whole answer."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.serve.restart import replica_states
from tests.e2e.conftest import SMALL_BUDGETS, stop
from tests.e2e.test_serve_replicas import Replicas, start_replicas, wait_for

pytestmark = pytest.mark.e2e

APP_NAME = "shardserve"  # --app-name's default
# Ongoing calls per replica Ray Serve aims at: the load keeps LOAD_CLIENTS (above it)
# in flight, the scale-down trickle one (below it).
TARGET_ONGOING = 2
LOAD_CLIENTS = 5
NEW_TOKENS = 24
# NOTE: Ray Serve averages ongoing calls over a 30 s look-back window, and drops a
# stopped replica's series from it: with a downscale delay shorter than the window, the
# replica left still has the load's calls in its window, and Ray Serve starts a second
# replica again a second after stopping one.
DOWNSCALE_DELAY_S = 30
FLAGS = [
    "--replicas",
    "1",
    "--min-replicas",
    "1",
    "--max-replicas",
    "2",
    "--target-ongoing-requests",
    str(TARGET_ONGOING),
    "--upscale-delay",
    "1",
    "--downscale-delay",
    str(DOWNSCALE_DELAY_S),
    "--kv-cache-bytes",
    "64MiB",
    "--graceful-timeout",
    "60",
    *SMALL_BUDGETS,
]
# NOTE: Ray Serve's handles (the ingress's, to the replicas) push their ongoing-call
# counts to the controller every 10 s by default, which would add up to 10 s to each
# scaling decision; the test has them push every second.
RAY_ENV = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
# Seconds for a scaling step: the window's mean must cross the target, a new replica
# loads and warms the model up, a removal waits DOWNSCALE_DELAY_S.
SCALE_TIMEOUT_S = 180.0
# Calls of the trickle, once back to one replica, during which it must stay at one.
CALLS_AT_ONE = 3
SUCCESS = "shardserve_requests_total:success"
# Prompts shorter than a KV block (16 tokens): no cached prefix ties a call to a
# replica, so the router sends each to the least loaded one.
PROMPTS = [
    "Count: 1, 2, 3,",
    "The capital of France is",
    "Once upon a time",
    "My favourite colour is",
]


@dataclass
class Answer:
    """One /generate_stream call: its prompt, HTTP status, events and, if the call
    failed before its end, why."""

    prompt: str
    status: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""

    def ids(self) -> list[object]:
        return [event["token"]["id"] for event in self.events]

    def problems(self) -> list[str]:
        """What makes this answer less than whole: empty if it has every token, in
        order, and one last event with details and the text of all tokens."""
        found = [self.failure] if self.failure else []
        if self.status != 200:
            found.append(f"status {self.status}")
        if [event.get("index") for event in self.events] != list(range(1, NEW_TOKENS + 1)):
            found.append(f"token indexes {[event.get('index') for event in self.events]}")
        if not self.events or any(event.get("details") for event in self.events[:-1]):
            return [*found, "no single last event"]
        last = self.events[-1]
        details = last["details"]
        if (details["finish_reason"], details["generated_tokens"]) != ("length", NEW_TOKENS):
            found.append(f"details {details}")
        texts = "".join(event["token"]["text"] for event in self.events)
        if last.get("generated_text") != texts:
            found.append("generated_text is not the tokens' text")
        return found


def call(url: str, prompt: str) -> Answer:
    """Stream ``prompt``'s NEW_TOKENS greedy tokens; an error event or a broken
    connection is kept as the answer's failure."""
    answer = Answer(prompt)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    try:
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
            answer.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        answer.failure = f"error event: {event['error']}"
                    else:
                        answer.events.append(event)
    except httpx.HTTPError as error:
        answer.failure = f"{type(error).__name__}: {error}"
    return answer


class Load:
    """``clients`` threads, each calling :func:`call` one call after another (client
    n asks ``PROMPTS[n % len(PROMPTS)]``) until :meth:`stop`."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(PROMPTS[n % len(PROMPTS)],))
            for n in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def _client(self, prompt: str) -> None:
        while not self._stop.is_set():
            self.answers.append(call(self.url, prompt))

    def stop(self) -> list[Answer]:
        """Let every client finish its call; return all the answers."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
            assert not thread.is_alive(), "a call of the load hung"
        return self.answers


@pytest.fixture(scope="module")
def autoscaled(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    started = start_replicas(FLAGS, tmp_path_factory.mktemp("autoscale") / "serve.log", env=RAY_ENV)
    yield started
    stop(started.process)


@pytest.fixture(scope="module")
def serve_states(autoscaled: Replicas) -> Iterator[Callable[[], dict[str, int]]]:
    """Ray Serve's own count of the ``Replica`` deployment's replicas by state, read
    from its controller (this process joins the application's Ray instance)."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address=autoscaled.ray_address(), log_to_driver=False)
        try:
            yield lambda: replica_states(APP_NAME)
        finally:
            ray.shutdown()


def served(replicas: Replicas, base: dict[str, dict[str, float]]) -> dict[str, float]:
    """Live replica → calls it served in full since ``base`` (a :meth:`counters` read)."""
    now = replicas.counters()
    return {r: now[r].get(SUCCESS, 0) - base.get(r, {}).get(SUCCESS, 0) for r in now}


def test_load_adds_a_replica_that_serves_and_its_end_removes_it_losing_no_call(
    autoscaled: Replicas, serve_states: Callable[[], dict[str, int]]
) -> None:
    url = autoscaled.url
    assert serve_states() == {"RUNNING": 1}
    base = autoscaled.settled()
    assert len(base) == 1, base
    states: list[dict[str, int]] = []

    def now_running(count: int) -> bool:
        states.append(serve_states())
        return states[-1] == {"RUNNING": count}

    load = Load(url, LOAD_CLIENTS)
    try:
        wait_for(
            lambda: now_running(2), SCALE_TIMEOUT_S, "a second running replica", lambda: states[-1:]
        )
        wait_for(
            lambda: (
                len(served(autoscaled, base)) == 2
                and all(n > 0 for n in served(autoscaled, base).values())
            ),
            60,
            "calls of the load served by both replicas",
            lambda: served(autoscaled, base),
        )
    finally:
        answers = load.stop()
    # the load ends; one client keeps calling (below the target) while Ray Serve stops
    # the replica it no longer needs
    trickle = Load(url, 1)
    try:
        wait_for(
            lambda: now_running(1), SCALE_TIMEOUT_S, "back to one replica", lambda: states[-1:]
        )
        back_at_one, calls = len(states) - 1, len(trickle.answers)
        wait_for(
            lambda: now_running(1) and len(trickle.answers) >= calls + CALLS_AT_ONE,
            120,
            f"{CALLS_AT_ONE} more calls",
            lambda: states[-1:],
        )
    finally:
        scale_down = trickle.stop()

    assert max(s.get("RUNNING", 0) for s in states) == 2, states
    assert all(s.get("RUNNING", 0) >= 1 for s in states), states  # always one serving
    assert all(s == {"RUNNING": 1} for s in states[back_at_one:]), states  # no rebound
    assert len(answers) >= 2 * LOAD_CLIENTS and scale_down, (len(answers), len(scale_down))
    broken = [(a.prompt, a.problems()) for a in answers + scale_down if a.problems()]
    assert not broken, f"{len(broken)} of {len(answers) + len(scale_down)} calls: {broken}"
    # greedy: every answer to a prompt has the same tokens, whichever replica gave it
    for prompt in PROMPTS:
        assert len({tuple(a.ids()) for a in answers + scale_down if a.prompt == prompt}) == 1
    wait_for(
        lambda: len(autoscaled.counters()) == 1, 30, "one replica in /metrics", autoscaled.counters
    )
