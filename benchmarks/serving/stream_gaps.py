"""Inter-token gaps of running streams while a long prompt is prefilled.

For each server configuration (``--configs``, launch flags per run, ``;``-separated):
starts ``shardserve launch --executor local`` on ``--model``, opens ``--streams``
streaming ``/v1/completions`` requests (``--stream-prompt`` token ids each, greedy,
``ignore_eos``), lets them decode for ``--warm`` seconds, then sends one non-streaming
request with a ``--long-prompt``-token prompt (``max_tokens`` 1) and keeps the streams
going until it is answered. Prints, per configuration: the streams' gap between tokens
before the long prompt (p50), while it was prefilled (p50 / p90 / max), the long
prompt's latency (≈ its TTFT), and the steps that prefilled (``/metrics``).

    python -m benchmarks.serving.stream_gaps --device cpu \
        --configs "--decode-during-prefill off;;--itl-target 0.5"

(An empty configuration is the defaults.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness import (
    free_port,
    header,
    metric_delta,
    percentile,
    scrape,
    start_server,
    stop_server,
    wait_healthy,
)

PREFILL_COUNT = "prefill_step_duration_seconds_count"


@dataclass
class GapRun:
    """One configuration's run.

    Attributes:
        before: Gaps between tokens of the streams before the long prompt was sent, s.
        during: Gaps that ended while it was in flight (or the first after it), s.
        long_s: Seconds from sending the long prompt to its answer.
        prefill_steps: Steps that computed prompt tokens during the run.
    """

    before: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    long_s: float = 0.0
    prefill_steps: float = 0.0


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                  arrivals: list[float], stop: asyncio.Event) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                arrivals.append(time.perf_counter())
            if stop.is_set():
                return  # closing the stream cancels the request


async def run_once(base: str, args: argparse.Namespace, rng: random.Random) -> GapRun:
    run = GapRun()
    stop = asyncio.Event()
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=args.streams + 2)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before_metrics = scrape((await client.get("/metrics")).text)
        arrivals: list[list[float]] = [[] for _ in range(args.streams)]
        streams = [asyncio.create_task(_stream(
            client, model, [rng.randrange(3, args.vocab) for _ in range(args.stream_prompt)],
            args.stream_tokens, arrivals[i], stop)) for i in range(args.streams)]
        await asyncio.sleep(args.warm)
        long_prompt = [rng.randrange(3, args.vocab) for _ in range(args.long_prompt)]
        sent = time.perf_counter()
        response = await client.post("/v1/completions", json={
            "model": model, "prompt": long_prompt, "max_tokens": 1, "temperature": 0})
        done = time.perf_counter()
        response.raise_for_status()
        await asyncio.sleep(2 * args.warm / 3)
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
        after_metrics = scrape((await client.get("/metrics")).text)
    run.long_s = done - sent
    run.prefill_steps = metric_delta(before_metrics, after_metrics).get(PREFILL_COUNT, 0.0)
    for times in arrivals:
        for previous, current in itertools.pairwise(times):
            if current <= sent:
                run.before.append(current - previous)
            elif previous <= done:
                run.during.append(current - previous)
    return run


def main() -> int:
    cache = Path(os.environ.get("SHARDSERVE_CACHE_DIR", Path.home() / ".cache" / "shardserve"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(cache / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", default="--decode-during-prefill off;",
                   help="launch flags of each run, ';'-separated (empty: the defaults)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-prompt", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=2000,
                   help="max_tokens of each stream (they are closed after the long prompt)")
    p.add_argument("--long-prompt", type=int, default=3490)
    p.add_argument("--warm", type=float, default=6.0,
                   help="seconds the streams decode before the long prompt")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args()

    print(header("Stream gaps during a long prefill", args.device, "torch"))
    print(f"\n{args.streams} streams of {args.stream_prompt}-token prompts; one "
          f"{args.long_prompt}-token prompt after {args.warm:.0f} s\n")
    print("| server flags | gap before p50 (s) | gap during p50 / p90 / max (s) "
          "| long prompt (s) | prefill steps |")
    print("|---|---:|---:|---:|---:|")
    for config in args.configs.split(";"):
        log_path = Path(tempfile.mkdtemp()) / "server.log"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(port, args.model, ["--device", args.device, *config.split()],
                            log_path)
        try:
            wait_healthy(proc, base, log_path, args.startup_timeout)
            run = asyncio.run(run_once(base, args, random.Random(0)))
        finally:
            stop_server(proc)
        during = run.during or [0.0]
        print(f"| {config.strip() or '(defaults)'} | {percentile(run.before, 50):.3f} "
              f"| {percentile(during, 50):.3f} / {percentile(during, 90):.3f} / "
              f"{max(during):.3f} | {run.long_s:.2f} | {run.prefill_steps:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
