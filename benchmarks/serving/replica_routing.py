"""Replica routing on a multi-turn chat workload: ``shardserve serve`` with 2 replicas
routed by prefix-cache affinity, round-robin and least-loaded, and with 1 replica.

Workload: ``--conversations`` chats, opened ``--stagger`` seconds apart and then run
at once, each ``--turns`` turns long; chat i opens with system prompt i mod
``--system-prompts`` (~265 tokens each) and a first message of its own (so no two
histories are equal), every turn appends a short user
message and the model's greedy answer (``--max-tokens``), so turn k's prompt holds all
of turns 1..k-1 and turn k+1 repeats turn k's prompt and answer: past the first turns
a conversation's history, not the system prompt, is most of its prompt. Each
conversation names itself in OpenAI's ``user`` field.

Measured over the public doors only: TTFT per turn (first streamed content chunk), the
replicas' prompt tokens and prefix-cache hit tokens from ``/metrics`` (by ``replica``
label), the ingress's routing counters (decisions, calls sent away from the replica
holding their longest cached prefix, hit tokens its index expected per replica),
generated tokens per second; preemptions from the replicas' logs (prompt tokens minus
hits is what the replicas computed only when nothing was preempted).

    python -m benchmarks.serving.replica_routing --out benchmarks/results/replica-routing-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import free_port, header, percentile, tail, wait_healthy

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOPICS = (
    "the rivers and mountains of Europe",
    "cooking with seasonal vegetables",
    "the history of early computers",
    "caring for house plants",
)
QUESTIONS = (
    "Give me one fact.",
    "Tell me more.",
    "Why is that?",
    "Name an example.",
    "Say it shorter.",
    "What else?",
    "Summarize.",
    "One more, please.",
)
BUDGETS = [
    "--max-input-tokens",
    "1536",
    "--max-total-tokens",
    "2048",
    "--max-batch-prefill-tokens",
    "1536",
]


def system_prompt(index: int) -> str:
    """A long system prompt (~250 tokens), one per topic."""
    topic = TOPICS[index % len(TOPICS)]
    rules = " ".join(
        f"Rule {n}: stay polite, precise and brief when you discuss {topic}." for n in range(1, 13)
    )
    return f"You are an expert assistant on {topic}. {rules}"


@dataclass
class Run:
    """One configuration's measurements; ``replicas``: replica id → (prompt tokens, its
    prefix-cache hit tokens, hit tokens the routing index expected there), summed over
    the run; ``decisions`` / ``passed_over``: the ingress's routing counters."""

    name: str
    ttfts: list[float]
    prompt_tokens: float
    hit_tokens: float
    generated_tokens: float
    wall_s: float
    failures: int
    replicas: dict[str, tuple[float, float, float]]
    decisions: dict[str, float]
    passed_over: dict[str, float]
    preempted: int


async def conversation(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    turns: int,
    system_prompts: int,
    max_tokens: int,
    ttfts: list[float],
) -> int:
    """One chat of ``turns`` turns; the TTFT of each goes to ``ttfts``; failures."""
    messages = [{"role": "system", "content": system_prompt(index % system_prompts)}]
    failures = 0
    for turn in range(turns):
        question = QUESTIONS[(index + turn) % len(QUESTIONS)]
        if turn == 0:  # NOTE: else chats i and i + 8 would be the same chat, token for token
            question = f"I am reader number {index}. {question}"
        messages.append({"role": "user", "content": question})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "user": f"conversation-{index}",
        }
        started = time.perf_counter()
        first: float | None = None
        text = []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                failures += 1
                await response.aread()
                continue
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    failures += 1
                    break
                content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
        if first is not None:
            ttfts.append(first - started)
        messages.append({"role": "assistant", "content": "".join(text)})
    return failures


def metric_by(text: str, name: str, label: str) -> dict[str, float]:
    """Sample ``name`` of a /metrics text by the value of its ``label``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def metric_sum(text: str, name: str) -> float:
    """The sum of sample ``name`` over every ``replica`` label of a /metrics text."""
    return sum(metric_by(text, name, "replica").values())


async def workload(url: str, args: argparse.Namespace) -> tuple[list[float], float, int]:
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()

        async def opened_later(i: int) -> int:
            await asyncio.sleep(i * args.stagger)
            return await conversation(
                client, url, i, args.turns, args.system_prompts, args.max_tokens, ttfts
            )

        failures = await asyncio.gather(*(opened_later(i) for i in range(args.conversations)))
        return ttfts, time.perf_counter() - started, sum(failures)


def run_config(
    name: str, replicas: int, routing: str, args: argparse.Namespace, log_dir: Path
) -> Run:
    port = free_port()
    log_path = log_dir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "serve",
        "--replicas",
        str(replicas),
        "--routing",
        routing,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--kv-cache-bytes",
        args.kv_cache_bytes,
        *BUDGETS,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path, 600)
        before = httpx.get(f"{url}/metrics", timeout=30).text
        ttfts, wall, failures = asyncio.run(workload(url, args))
        time.sleep(1.5)  # each replica posts its metrics every 0.5 s
        after = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            sys.stderr.write(tail(log_path))

    def delta(metric: str, label: str = "replica") -> dict[str, float]:
        was = metric_by(before, metric, label)
        return {
            key: value - was.get(key, 0.0) for key, value in metric_by(after, metric, label).items()
        }

    prompts = delta("shardserve_prompt_tokens_total")
    hits = delta("shardserve_prefix_cache_hit_tokens_total")
    expected = delta("shardserve_routing_expected_hit_tokens_total")
    per_replica = {
        replica: (prompts[replica], hits.get(replica, 0.0), expected.get(replica, 0.0))
        for replica in prompts
    }
    # NOTE: prompt tokens minus hits is what the replicas computed only without
    # preemption (a recompute is neither a prompt token nor always a hit): counted here.
    preempted = log_path.read_text(errors="replace").count("preempted request")
    return Run(
        name,
        ttfts,
        sum(prompts.values()),
        sum(hits.values()),
        sum(delta("shardserve_generation_tokens_total").values()),
        wall,
        failures,
        per_replica,
        delta("shardserve_routing_decisions_total", "reason"),
        delta("shardserve_routing_passed_over_total", "reason"),
        preempted,
    )


def table(runs: list[Run]) -> str:
    rows = [
        "| configuration | prompt tokens | cache hit rate | prefill tokens computed | "
        "vs round-robin | TTFT p50 (s) | TTFT p99 (s) | gen tok/s | wall (s) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    robin = next((r for r in runs if r.name.startswith("round_robin")), None)
    for run in runs:
        computed = run.prompt_tokens - run.hit_tokens
        ratio = (
            f"{computed / (robin.prompt_tokens - robin.hit_tokens):.2f}x"
            if robin and robin.prompt_tokens > robin.hit_tokens
            else "-"
        )
        rows.append(
            f"| {run.name} | {run.prompt_tokens:.0f} | {run.hit_tokens / run.prompt_tokens:.1%} | "
            f"{computed:.0f} | {ratio} | {percentile(run.ttfts, 50):.3f} | "
            f"{percentile(run.ttfts, 99):.3f} | {run.generated_tokens / run.wall_s:.1f} | "
            f"{run.wall_s:.1f} | {run.failures} |"
        )
    return "\n".join(rows)


def diagnostics(runs: list[Run]) -> str:
    """Per replica: prompt tokens, prefix-cache hits (the replica's counter) and the
    hits the routing index expected; per configuration: routing decisions, calls sent
    away from the replica holding their longest cached prefix, preemptions."""
    rows = [
        "| configuration | replica | prompt tokens | hit tokens (replica) | "
        "hit tokens (index expected) | decisions | passed over | preempted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.decisions.items()) if v)
        passed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.passed_over.items()) if v)
        for n, (replica, (prompt, hit, expected)) in enumerate(sorted(run.replicas.items())):
            rows.append(
                f"| {run.name if n == 0 else ''} | {replica[:8]} | {prompt:.0f} | "
                f"{hit:.0f} | {expected:.0f} | {decisions if n == 0 else ''} | "
                f"{(passed or '-') if n == 0 else ''} | "
                f"{run.preempted if n == 0 else ''} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument(
        "--stagger",
        type=float,
        default=0.5,
        help="seconds between two conversations' first turns (0: all at once)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--kv-cache-bytes", default="1GiB", help="per replica")
    parser.add_argument(
        "--configs", nargs="+", default=["affinity", "round_robin", "least_loaded", "one_replica"]
    )
    parser.add_argument("--out", type=Path, default=None, help="append the table here")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/replica-routing"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for config in args.configs:
        replicas, routing = (1, "affinity") if config == "one_replica" else (2, config)
        name = f"{config} ({replicas} replica{'s' if replicas > 1 else ''})"
        runs.append(run_config(name, replicas, routing, args, args.log_dir))
        print(f"{name}: done in {runs[-1].wall_s:.1f} s", file=sys.stderr)
    text = (
        f"{header('replica routing: multi-turn chat', 'cpu', 'ray', 'torch')}\n\n"
        f"{args.conversations} conversations x {args.turns} turns, opened {args.stagger} s "
        "apart, "
        f"{args.system_prompts} shared system prompts, {args.max_tokens} tokens per "
        f"answer, default model, --kv-cache-bytes {args.kv_cache_bytes} per replica\n\n"
        f"{table(runs)}\n\n{diagnostics(runs)}\n"
    )
    print(text)
    if args.out:
        with args.out.open("a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
