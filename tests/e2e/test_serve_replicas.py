"""``shardserve serve``: two replicas of the default model on Ray Serve (local Ray, CPU),
called through Serve's HTTP and gRPC proxies with real clients."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from router.pb import generate_pb2 as pb
from router.pb import generate_pb2_grpc
from router.serve.health_watch import INGRESS_STOPPING
from tests.e2e.conftest import SMALL_BUDGETS, stop, wait_healthy
from tests.ports import unused_port

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A prompt head of several KV blocks that the prefix test shares between requests.
SHARED = "You are a careful assistant who answers questions about European geography. " * 8
STARTUP_TIMEOUT_S = 600.0
REPLACE_TIMEOUT_S = 300.0
# The application's flags (the rolling restart deploys the same); a long grace, so that
# a replica drained by the rolling restart finishes the streams it has.
SERVE_FLAGS = ["--replicas", "2", "--kv-cache-bytes", "64MiB", "--graceful-timeout", "120",
               *SMALL_BUDGETS]


class Replicas:
    """The running ``shardserve serve``: its URL, gRPC address, process and log."""

    def __init__(self, url: str, grpc_address: str, process: subprocess.Popen[bytes],
                 log_path: Path) -> None:
        self.url, self.grpc_address, self.process, self.log_path = (
            url, grpc_address, process, log_path)

    def ray_address(self) -> str:
        """The address of the local Ray instance, as ``shardserve serve`` logged it."""
        found = re.search(r"started a local Ray instance at (\S+)", self.log_path.read_text())
        assert found, "shardserve serve logged no Ray address"
        return found.group(1)

    def counters(self) -> dict[str, dict[str, float]]:
        """Live replica id → metric sample name (with its outcome label, if any) →
        value, from the series the replicas report (the ingress's routing counters,
        labelled by the replica they chose, also name replicas that are gone)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name.startswith("shardserve_routing_"):
                continue
            for sample in family.samples:
                replica = sample.labels.get("replica")
                if replica is not None:
                    outcome = sample.labels.get("outcome")
                    name = sample.name + (f":{outcome}" if outcome else "")
                    out.setdefault(replica, {})[name] = sample.value
        return out

    def settled(self) -> dict[str, dict[str, float]]:
        """:meth:`counters` once two reads a posting period apart agree (each replica
        posts its metrics every 0.5 s: a read right after a request may predate it)."""
        last = self.counters()
        for _ in range(60):
            time.sleep(1.0)
            now = self.counters()
            if now == last:
                return now
            last = now
        raise AssertionError("the replicas' metrics never settled")

    def replica_pids(self) -> list[int]:
        """Pids of the Serve replica actors of the ``Replica`` deployment (processes
        under the server's, titled by Ray)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::ServeReplica:shardserve:Replica"):
                found.append(pid)
        return found


def start_replicas(flags: list[str], log_path: Path,
                   env: dict[str, str] | None = None) -> Replicas:
    """Start ``shardserve serve FLAGS`` on free ports, logging to ``log_path`` (with
    ``env`` added to the environment); return it once /health answers."""
    port, grpc_port = unused_port(), unused_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", *flags,
             "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, STARTUP_TIMEOUT_S)
    except Exception:
        stop(process)
        sys.stderr.write(log_path.read_text()[-5000:])
        raise
    return Replicas(url, f"127.0.0.1:{grpc_port}", process, log_path)


@pytest.fixture(scope="module")
def replicas(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Replicas]:
    started = start_replicas(SERVE_FLAGS, tmp_path_factory.mktemp("serve") / "serve.log")
    yield started
    stop(started.process)


@pytest.fixture(scope="module")
def reference_text(default_model_dir: Path) -> str:
    """transformers' greedy continuation (float32, 20 new tokens): what one replica
    answers (tests/e2e/test_default_model.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    return str(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:],
                                skip_special_tokens=True))


def sse_data(response: httpx.Response) -> list[dict[str, object]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


def test_every_api_gives_the_one_replica_tokens_on_both_replicas(
    replicas: Replicas, reference_text: str
) -> None:
    url = replicas.url
    before = replicas.settled()
    for n in range(4):  # new conversations take turns over the idle replicas
        headers = {"x-conversation-id": f"same-{n}"}
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}
        answer = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == reference_text
        with httpx.stream("POST", f"{url}/generate_stream", json=body, headers=headers,
                          timeout=120) as stream:
            events = sse_data(stream)
        assert "".join(e["token"]["text"] for e in events) == reference_text  # type: ignore[index]
        completion = httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0})
        assert completion.json()["choices"][0]["text"] == reference_text
    after = replicas.settled()
    served = {r: after[r].get("shardserve_requests_total:success", 0)
              - before.get(r, {}).get("shardserve_requests_total:success", 0) for r in after}
    assert len(served) == 2 and all(count > 0 for count in served.values()), served

    chat = {"model": MODEL, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True},
                      timeout=120) as stream:
        chunks = sse_data(stream)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)  # type: ignore[index]
    assert streamed == whole["choices"][0]["message"]["content"] != ""

    with grpc.insecure_channel(replicas.grpc_address) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.Parameters(max_new_tokens=20))
        assert stub.Generate(request, timeout=120).sequence.generated_text == reference_text
        tokens = [m.token.text for m in stub.GenerateStream(request, timeout=120)]
        assert "".join(tokens) == reference_text
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(pb.GenerateRequest(inputs=PROMPT, parameters=pb.Parameters(
                max_new_tokens=20, temperature=-1)), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in (refused.value.details() or "")


HEALTH = health_pb2.HealthCheckResponse
SERVICE = "shardserve.generate.v1.TextGeneration"


def first_watched(address: str, service: str) -> int:
    """The first status a health Watch of ``service`` through ``address`` sends."""
    with grpc.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=60)
        status: int = next(call).status
        call.cancel()
        return status


class WatchStream:
    """A health Watch through the proxy in a thread: the statuses it sent, and the
    code and details it ended with (None while it runs)."""

    def __init__(self, address: str) -> None:
        self.statuses: list[int] = []
        self.ending: tuple[grpc.StatusCode, str] | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self.thread.start()

    def _run(self, address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                            timeout=600)
            try:
                for message in call:
                    self.statuses.append(message.status)
                    self.first.set()
                self.ending = (grpc.StatusCode.OK, "")
            except grpc.RpcError as error:
                self.ending = (error.code(), error.details() or "")


def test_grpc_health_and_reflection_through_the_proxy_are_the_one_replica_servers(
    replicas: Replicas,
) -> None:
    with grpc.insecure_channel(replicas.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=60)
            assert answer.status == HEALTH.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=60)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        [listed] = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=60)
        names = {service.name for service in listed.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names, names
        [described] = reflection.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]), timeout=60)
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw
                 in described.file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service for m in s.method}
        assert methods == {"Generate", "GenerateStream", "Tokenize", "ModelInfo"}, methods
    assert first_watched(replicas.grpc_address, "") == HEALTH.SERVING
    assert first_watched(replicas.grpc_address, SERVICE) == HEALTH.SERVING
    assert first_watched(replicas.grpc_address, "no.Such") == HEALTH.SERVICE_UNKNOWN


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             seen: Callable[[], object] = lambda: None) -> None:
    """Poll ``condition`` every 0.5 s (metrics reach /metrics within a period)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s: {what} (seen: {seen()})")


def test_shared_prefix_lands_on_the_replica_holding_it(replicas: Replicas) -> None:
    url = replicas.url
    body = {"inputs": SHARED + "Question 0: Paris?", "parameters": {"max_new_tokens": 2}}
    start = replicas.settled()
    assert httpx.post(f"{url}/generate", json=body, timeout=120).status_code == 200

    def served_since(base: dict[str, dict[str, float]], name: str) -> dict[str, float]:
        now = replicas.counters()
        return {r: now[r].get(name, 0) - base.get(r, {}).get(name, 0) for r in now}

    wait_for(lambda: sum(served_since(start, "shardserve_requests_total:success").values()) == 1,
             30, "the first request counted", replicas.counters)
    [holder] = [r for r, n in served_since(start, "shardserve_requests_total:success").items()
                if n == 1]
    base = replicas.settled()
    for n in range(1, 4):
        body = {"inputs": SHARED + f"Question {n}: Rome?", "parameters": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=body, timeout=120).status_code == 200
    wait_for(lambda: sum(served_since(base, "shardserve_requests_total:success").values()) == 3,
             30, "three requests counted", lambda: (base, replicas.counters()))
    served = served_since(base, "shardserve_requests_total:success")
    hits = served_since(base, "shardserve_prefix_cache_hit_tokens_total")
    assert served[holder] == 3, served
    assert hits[holder] >= 3 * 96, hits  # the shared head is > 6 blocks of 16 tokens
    assert all(hits[r] == 0 for r in hits if r != holder), hits


def test_a_killed_replica_is_replaced_and_its_calls_end_with_an_error(
    replicas: Replicas,
) -> None:
    url = replicas.url
    old = set(replicas.counters())
    endings: dict[int, str] = {}
    first_tokens = threading.Semaphore(0)

    def stream(n: int) -> None:
        body = {"inputs": f"Story {n}: once upon a time",
                "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
        headers = {"x-conversation-id": f"kill-{n}"}
        seen = 0
        with httpx.stream("POST", f"{url}/generate_stream", json=body, headers=headers,
                          timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                seen += 1
                if seen == 1:
                    first_tokens.release()
                if "error" in event:
                    endings[n] = "error: " + event["error"]
                elif event.get("details"):
                    endings[n] = "finished"
        endings.setdefault(n, "cut")

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert first_tokens.acquire(timeout=120), "a stream never started"
    wait_for(lambda: all(v.get("shardserve_running_batch_size", 0) > 0
                         for v in replicas.counters().values()),
             30, "streams running on both replicas",
             lambda: {r: v.get("shardserve_running_batch_size")
                      for r, v in replicas.counters().items()})
    pids = replicas.replica_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], 9)
    # the other replica serves meanwhile
    answer = httpx.post(f"{url}/generate", timeout=120,
                        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert answer.status_code == 200, answer.text
    for thread in threads:
        thread.join(timeout=180)
        assert not thread.is_alive(), "a stream hung after its replica was killed"
    lost = [e for e in endings.values() if e.startswith("error:")]
    assert lost and all("replica serving this request stopped" in e for e in lost), endings
    assert all(e == "finished" or e in lost for e in endings.values()), endings
    wait_for(lambda: len(set(replicas.counters()) - old) == 1
             and len(replicas.counters()) == 2, REPLACE_TIMEOUT_S, "a replacement replica")
    answer = httpx.post(f"{url}/generate", timeout=120,
                        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert answer.status_code == 200


# A prompt whose greedy answer counts on: a token lost, repeated or reordered shows.
COUNTING = "Count: 1, 2, 3,"
# Tokens of each long stream of the rolling-restart test: ~20 s on this CPU, longer than
# a replica's replacement (stop, start, warm-up: 7-13 s).
LONG_TOKENS = 160
# Long streams sent once the first replica is gone: they land on the other one, which
# is drained next with them in flight.
EXTRA_STREAMS = 2


class Stream:
    """A /generate_stream call of :data:`COUNTING` in a thread: its status, token ids
    and how it ended (``finished``, ``error: ...`` or ``cut``)."""

    def __init__(self, url: str, conversation: str) -> None:
        self.url, self.conversation = url, conversation
        self.status = 0
        self.ids: list[int] = []
        self.ending = "cut"
        self.first_token = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {"inputs": COUNTING,
                "parameters": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}}
        with httpx.stream("POST", f"{self.url}/generate_stream", json=body, timeout=300,
                          headers={"x-conversation-id": self.conversation}) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    self.ending = "error: " + event["error"]
                    continue
                self.ids.append(event["token"]["id"])
                self.first_token.set()
                if event.get("details"):
                    self.ending = "finished"

    def join(self) -> None:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), f"stream {self.conversation} hung"


def replica_states(output: str) -> list[dict[str, int]]:
    """The replica states the rolling restart logged, in order (``RUNNING=1 STOPPING=1``
    → {"RUNNING": 1, "STOPPING": 1})."""
    return [{state: int(count) for state, count in re.findall(r"(\w+)=(\d+)", line)}
            for line in re.findall(r"replica states: (.*)", output)]


def test_a_rolling_restart_replaces_the_replicas_one_at_a_time_dropping_no_call(
    replicas: Replicas, tmp_path: Path
) -> None:
    url = replicas.url
    short = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    expected_short = httpx.post(f"{url}/generate", json=short, timeout=120).json()
    old_replicas, old_pids = set(replicas.counters()), set(replicas.replica_pids())
    assert len(old_replicas) == 2 and len(old_pids) == 2, (old_replicas, old_pids)

    in_flight = [Stream(url, f"restart-{n}") for n in range(4)]
    for stream in in_flight:
        assert stream.first_token.wait(timeout=120), "a stream never started"
    wait_for(lambda: all(v.get("shardserve_running_batch_size", 0) > 0
                         for v in replicas.counters().values()),
             30, "streams running on both replicas", replicas.counters)

    watch = WatchStream(replicas.grpc_address)
    assert watch.first.wait(timeout=60), "the health Watch sent nothing"
    log_path = tmp_path / "restart.log"
    with log_path.open("wb") as log:
        restart = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--rolling-restart", "on",
             "--ray-address", replicas.ray_address(), *SERVE_FLAGS],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    # New calls while the replicas are replaced: short ones in a row, and long streams
    # once the first replica is gone (before its successor runs, the other one takes
    # them, and is stopped with them in flight).
    answers: list[tuple[int, object]] = []
    extra: list[Stream] = []
    while restart.poll() is None:
        states = replica_states(log_path.read_text())
        first_gone = any(s.get("STOPPING") for s in states) and not states[-1].get("STOPPING")
        if first_gone and not extra:
            extra = [Stream(url, f"restart-extra-{n}") for n in range(EXTRA_STREAMS)]
        answer = httpx.post(f"{url}/generate", json=short, timeout=120)
        answers.append((answer.status_code, answer.json()))
        time.sleep(0.5)
    output = log_path.read_text()
    assert restart.returncode == 0, output[-5000:]
    for stream in in_flight + extra:
        stream.join()
    assert replicas.process.poll() is None, "shardserve serve stopped"
    # the Watch through the old ingress ended when it was replaced; the new one answers
    watch.thread.join(timeout=60)
    assert watch.ending == (grpc.StatusCode.UNAVAILABLE, INGRESS_STOPPING), watch.ending
    assert watch.statuses[0] == HEALTH.SERVING, watch.statuses
    assert first_watched(replicas.grpc_address, "") == HEALTH.SERVING

    reference = Stream(url, "restart-reference")
    reference.join()
    assert reference.ending == "finished" and len(reference.ids) == LONG_TOKENS
    for stream in in_flight + extra:
        assert (stream.status, stream.ending) == (200, "finished"), stream.ending
        assert stream.ids == reference.ids, stream.conversation
    assert extra and answers, "the restart ended before any new call"
    assert all(answer == (200, expected_short) for answer in answers), answers

    # Ray Serve's replica states, as the restart logged each change: one replica
    # stopping at a time, and always one running.
    states = replica_states(output)
    assert states[0] == {"RUNNING": 2} and states[-1] == {"RUNNING": 2}, states
    assert any(s.get("STOPPING") for s in states), states
    assert all(s.get("RUNNING", 0) >= 1 and s.get("STOPPING", 0) <= 1
               and s.get("STARTING", 0) <= 1 for s in states), states
    # both replicas are new: their Serve ids (the /metrics label) and processes
    wait_for(lambda: len(replicas.counters()) == 2
             and not set(replicas.counters()) & old_replicas,
             30, "two new replicas in /metrics", replicas.counters)
    new_pids = set(replicas.replica_pids())
    assert len(new_pids) == 2 and not new_pids & old_pids, (old_pids, new_pids)
