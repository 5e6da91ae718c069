"""Serving benchmark: shardserve over HTTP against Hugging Face ``transformers`` ``generate``.

What is measured
----------------
* **shardserve**: the script starts ``shardserve launch --executor local`` on a free port
  (public gRPC API off), waits for ``/health``, sends a few warm-up requests, then sends a
  fixed set of prompts of varied lengths (8 base prompts, ≈15 to ≈630 tokens, cycled) to
  ``POST /generate_stream`` (server-sent events, TGI format) at each concurrency (1, 8 and
  32 by default: at most that many requests in flight, a new one sent as soon as one
  finishes); ``--num-prompts`` requests per run, ``--num-prompts-c1`` at concurrency 1.
  Greedy decoding, ``ignore_eos: true``, so every request generates exactly
  ``--max-new-tokens`` tokens. Per run:

  - output tokens/s = token events received / wall time from the first send to the last
    completion;
  - TTFT = time from sending the request to its first token event (p50, p99 over requests);
  - TPOT = (last token time - first token time) / (tokens - 1) per request (p50, p99);
  - peak RSS of the router process (``shardserve launch``) and of the shard process (its
    child ``shard.server``, found with psutil), sampled every 20 ms in a thread;
  - the router's share of a decode step, from the server's Prometheus histograms at
    ``/metrics``: mean of ``shardserve_decode_step_wall_seconds`` (step as seen by the
    router, around the gRPC call) minus mean of ``shardserve_decode_step_duration_seconds``
    (forward time reported by the shard), both from the ``_sum``/``_count`` deltas over
    the run.

  Every run prefixes its prompts with a run tag, so no run reuses KV blocks of an earlier
  one through the prefix cache (the hit counter is checked and reported).
* **transformers** (the peer), in the same process after the server has been stopped:
  the same model folder in float32, the same prompts (with the same tags) in static
  batches of the concurrency's size, left padding, greedy, ``min_new_tokens =
  max_new_tokens`` so that EOS cannot end a sequence early. Output tokens/s = real
  generated tokens (each row counted up to its first EOS or the limit, never padding) /
  total ``generate`` time; per-batch latency p50/p99.

Both sides use the same number of torch threads (``--threads``, default: half the cores,
leaving the rest to the router process): ``OMP_NUM_THREADS`` for the server processes,
``torch.set_num_threads`` for the peer.

Usage: ``python -m benchmarks.serving.cpu_serving [--num-prompts 32] [--max-new-tokens 64]
[--concurrency 1,8,32] [--skip-peer] [--output benchmarks/results/serving-cpu.md]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.harness import (
    cpu_model,
    decode_step_means,
    find_shard,
    free_port,
    metric_delta,
    percentile,
    prefix_hits,
    scrape,
    start_server,
    stop_server,
    today,
    versions,
    wait_healthy,
)

MIB = 1024 * 1024

# Fixed prompt set: short questions to long passages (≈15 to ≈630 tokens with the tag).
_PASSAGE = (
    "The river rose slowly through the night, covering the low fields first and then the "
    "road that led from the village to the market town. By morning the old stone bridge "
    "stood alone in a wide brown lake, and the farmers gathered on the hill to watch. "
)
BASE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "List three differences between a list and a tuple in Python, with an example of each.",
    "You are a helpful assistant. A customer writes: my order arrived damaged and I need "
    "a replacement before Friday. Draft a short, polite reply that apologises, explains "
    "the next steps and asks for a photo of the damage.",
    "Summarise the following story in two sentences.\n\n" + _PASSAGE * 3,
    "Continue this story for one more paragraph.\n\n" + _PASSAGE * 6,
    "Read the text and answer: what did the farmers do?\n\n" + _PASSAGE * 12,
]


def make_prompts(n: int, tag: str) -> list[str]:
    return [f"[{tag}-{i}] {BASE_PROMPTS[i % len(BASE_PROMPTS)]}" for i in range(n)]


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts_c1 if concurrency == 1 else args.num_prompts


class RssSampler(threading.Thread):
    """Samples the RSS of named processes; ``take()`` returns the peaks and resets them."""

    def __init__(self, procs: dict[str, psutil.Process], interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.procs, self.interval = procs, interval
        self.peaks = dict.fromkeys(procs, 0)
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            for name, proc in self.procs.items():
                try:
                    self.peaks[name] = max(self.peaks[name], proc.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(self.interval)

    def take(self) -> dict[str, int]:
        peaks, self.peaks = self.peaks, dict.fromkeys(self.procs, 0)
        return peaks


# ---- shardserve over HTTP ------------------------------------------------------------------

@dataclass
class RequestStats:
    sent: float
    times: list[float] = field(default_factory=list)


@dataclass
class ServerRun:
    concurrency: int
    requests: int
    tokens: int
    wall: float
    ttft: list[float]
    tpot: list[float]
    rss: dict[str, int]
    metrics: dict[str, float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall


async def one_request(client: httpx.AsyncClient, prompt: str, max_new_tokens: int,
                      sem: asyncio.Semaphore) -> RequestStats:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens,
                                             "do_sample": False, "ignore_eos": True}}
    async with sem:
        stats = RequestStats(sent=time.perf_counter())
        async with client.stream("POST", "/generate_stream", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"server error: {event['error']}")
                if "token" in event:
                    stats.times.append(time.perf_counter())
                if event.get("generated_text") is not None:
                    break
    return stats


async def run_server_load(base: str, prompts: list[str], concurrency: int,
                          max_new_tokens: int, sampler: RssSampler | None) -> ServerRun:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        before = scrape((await client.get("/metrics")).text)
        if sampler:
            sampler.take()
        sem = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, p, max_new_tokens, sem) for p in prompts))
        wall = time.perf_counter() - start
        rss = sampler.take() if sampler else {}
        after = scrape((await client.get("/metrics")).text)
    delta = metric_delta(before, after)
    return ServerRun(
        concurrency=concurrency, requests=len(results),
        tokens=sum(len(r.times) for r in results), wall=wall,
        ttft=[r.times[0] - r.sent for r in results if r.times],
        tpot=[(r.times[-1] - r.times[0]) / (len(r.times) - 1)
              for r in results if len(r.times) > 1],
        rss=rss, metrics=delta)


def bench_server(args: argparse.Namespace) -> tuple[list[ServerRun], float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"shardserve-bench-{port}.log"
    started = time.perf_counter()
    proc = start_server(port, args.model, args.server_args.split(), log_path,
                        env={"OMP_NUM_THREADS": str(args.threads), "RAY_AUTH_MODE": "disabled"})
    try:
        wait_healthy(proc, base, log_path, args.startup_timeout)
        startup = time.perf_counter() - started
        print(f"server up on {base} after {startup:.0f}s (log: {log_path})", file=sys.stderr)
        sampler = RssSampler({"router": psutil.Process(proc.pid), "shard": find_shard(proc)})
        warm = make_prompts(4, "warmup")
        asyncio.run(run_server_load(base, warm, 4, 8, None))
        runs = []
        for c in args.concurrency:
            run = asyncio.run(run_server_load(
                base, make_prompts(num_prompts(args, c), f"c{c}"), c, args.max_new_tokens, sampler))
            print(f"shardserve c={c}: {run.tok_s:.1f} tok/s", file=sys.stderr)
            runs.append(run)
        sampler.stop.set()
        return runs, startup
    finally:
        stop_server(proc)


# ---- the peer: transformers generate ----------------------------------------------------

@dataclass
class PeerRun:
    concurrency: int
    requests: int
    tokens: int
    wall: float
    batch_latency: list[float]
    rss: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall


def bench_peer(args: argparse.Namespace) -> list[PeerRun]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    sampler = RssSampler({"peer": psutil.Process()})

    def generate(prompts: list[str], n: int) -> tuple[int, float]:
        batch = tok(prompts, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=tok.pad_token_id)
        elapsed = time.perf_counter() - t0
        real = 0
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            stop = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            real += min(stop, n)
        return real, elapsed

    generate(make_prompts(2, "warmup"), 8)
    runs = []
    for c in args.concurrency:
        prompts = make_prompts(num_prompts(args, c), f"c{c}")
        sampler.take()
        tokens, latencies = 0, []
        for i in range(0, len(prompts), c):
            real, elapsed = generate(prompts[i:i + c], args.max_new_tokens)
            tokens += real
            latencies.append(elapsed)
        run = PeerRun(c, len(prompts), tokens, sum(latencies), latencies, sampler.take()["peer"])
        print(f"transformers c={c}: {run.tok_s:.1f} tok/s", file=sys.stderr)
        runs.append(run)
    sampler.stop.set()
    return runs


# ---- report ------------------------------------------------------------------------------

def report(args: argparse.Namespace, runs: list[ServerRun], peer: list[PeerRun],
           startup: float, load: tuple[float, float]) -> str:

    ms = 1000.0
    lines = [
        "# Serving benchmark (CPU)", "",
        f"- date: {today()}",
        f"- device: {cpu_model()}, {os.cpu_count()} cores; load average 1 min "
        f"{load[0]:.1f} at start, {load[1]:.1f} at end",
        f"- versions: {versions('torch', 'transformers', 'shardserve')}",
        f"- model: {args.model} (float32)",
        f"- parameters: {args.num_prompts} requests per run ({args.num_prompts_c1} at "
        f"concurrency 1), prompts cycling over 8 base prompts of ~15-630 tokens, tagged "
        f"per run; max_new_tokens {args.max_new_tokens}, greedy, EOS ignored on both "
        f"sides (server `ignore_eos: true`, peer `min_new_tokens = max_new_tokens`), "
        f"concurrency {','.join(map(str, args.concurrency))}",
        f"- threads: {args.threads} torch threads for the shard (`OMP_NUM_THREADS`) and the "
        f"peer (`torch.set_num_threads`); server `shardserve launch --executor local "
        f"{args.server_args}".rstrip() + f"`, ready after {startup:.0f}s", "",
        "## shardserve (HTTP, /generate_stream)", "",
        "| concurrency | requests | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| decode step: router-seen / shard forward / router share (ms) | peak RSS router / "
        "shard (MiB) | prefix-cache hits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        wall, fwd = (t * ms for t in decode_step_means(r.metrics))
        hits = prefix_hits(r.metrics)
        lines.append(
            f"| {r.concurrency} | {r.requests} | {r.tok_s:.1f} "
            f"| {percentile(r.ttft, 50) * ms:.0f} / {percentile(r.ttft, 99) * ms:.0f} "
            f"| {percentile(r.tpot, 50) * ms:.1f} / {percentile(r.tpot, 99) * ms:.1f} "
            f"| {wall:.1f} / {fwd:.1f} / {wall - fwd:.2f} ({(wall - fwd) / wall:.1%}) "
            f"| {r.rss['router'] / MIB:.0f} / {r.rss['shard'] / MIB:.0f} | {hits:.0f} |")
    if peer:
        lines += [
            "", "## transformers generate (static batches, same process after the server "
            "stopped)", "",
            "| batch size | requests | output tok/s | batch latency p50 / p99 (ms) "
            "| peak RSS (MiB) | shardserve / transformers tok/s |",
            "|---|---|---|---|---|---|",
        ]
        ours = {r.concurrency: r for r in runs}
        for p in peer:
            ratio = f"{ours[p.concurrency].tok_s / p.tok_s:.2f}x" if p.concurrency in ours else "-"
            lines.append(
                f"| {p.concurrency} | {p.requests} | {p.tok_s:.1f} "
                f"| {percentile(p.batch_latency, 50) * ms:.0f} / "
                f"{percentile(p.batch_latency, 99) * ms:.0f} | {p.rss / MIB:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    default_model = Path(os.environ.get("SHARDSERVE_CACHE_DIR",
                                        Path.home() / ".cache" / "shardserve"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--num-prompts-c1", type=int, default=len(BASE_PROMPTS),
                        help="requests of the concurrency-1 runs (sequential, the slowest)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads of the shard and of the peer (default: half "
                             "the cores, the other half is for the router)")
    parser.add_argument("--model", default=str(default_model / "models" /
                                               "SmolLM2-135M-Instruct"),
                        help="model folder (default: the server's default model)")
    parser.add_argument("--server-args", default="",
                        help="extra flags for shardserve launch, one string")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    load_start = os.getloadavg()[0]
    runs, startup = bench_server(args)
    peer = [] if args.skip_peer else bench_peer(args)
    text = report(args, runs, peer, startup, (load_start, os.getloadavg()[0]))
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)


if __name__ == "__main__":
    main()
