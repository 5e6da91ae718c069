"""Router cost per decode step: the real engine, scheduler, detokenizer and stop checks
over a shard group that answers at once, so that all the time measured is the router's.

With overlapped scheduling the shards compute step N+1 while the router processes step
N; the GPU waits for the router only when this per-step cost exceeds the device's step
time (about 9–12 ms for Llama-3-8B dimensions at 256 sequences on an H200). Each row runs
``--requests`` requests of ``--new-tokens`` greedy tokens (``ignore_eos``) at once.
``engine`` rows read every event from :meth:`Engine.generate`; ``http`` rows serve the
real app (``POST /v1/completions``, streamed as server-sent events or answered whole)
with the server's HTTP stack, to clients in a separate process. The cost is the CPU time
of the router's process per decode step.

With ``--device-ms F`` the shard group becomes a virtual device instead: steps run one
after another, each for F ms of wall time from the later of its arrival and the previous
step's end (as a GPU runs the launched steps in order), and each row also gives the
router's step period (wall time per decode step) against F: with overlapped scheduling
the period stays at F until the router's own work per step no longer fits beside it.
``--shards grpc`` puts that device in a shard process of its own behind the real gRPC
server and client (:mod:`benchmarks.steps.virtual_shard`), so the period also pays for the
protocol: serialization and transport both ways, the servicer's step ordering and
worker threads.

With ``--step-trace-dir DIR`` (default ``$STEP_TRACE_DIR``) the router and the gRPC
shard process append their step timestamps there (``benchmarks/steps/step_chain.py`` reads
them).

    python -m benchmarks.steps.router_step --requests 1 64 256
    python -m benchmarks.steps.router_step --requests 256 --device-ms 10 --steps-in-flight 1 2 \
        --shards local grpc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO_ROOT, free_port, header
from router.api.app import create_app
from router.api.http_server import make_http_server
from router.api.state import ServerState
from router.config import SchedulerConfig, ValidationLimits
from router.engine.loop import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.shard_client import ShardClient
from router.step_trace import NullTrace, StepTrace, Trace, step_trace
from router.tokenizer import Tokenizer
from router.validation import Validator
from shard.pb import shard_pb2 as pb

DEFAULT_TOKENIZER = Path.home() / ".cache/shardserve/models/SmolLM2-135M-Instruct"
TEXT = " The quick brown fox jumps over the lazy dog, and then it runs away."


@dataclass
class InstantShards:
    """A shard group that answers every call at once: each request emits ``ids``
    cyclically. It keeps the step contract (requests held by id until finished, chunks
    by id, every decoding row in each Decode, in row order)."""

    ids: list[int]
    num_blocks: int
    block_size: int = 16
    generated: dict[int, int] = field(default_factory=dict)
    held: dict[int, list[int]] = field(default_factory=dict)  # id -> [cached, total]
    rows: list[int] = field(default_factory=list)  # decoding rows, in row order
    stepping: list[int] = field(default_factory=list)  # the last mixed step's rows
    restart: bool = False
    hung_rank: int | None = None

    def _next(self, request_id: int) -> int:
        count = self.generated.get(request_id, 0)
        self.generated[request_id] = count + 1
        return self.ids[count % len(self.ids)]

    def restart_steps(self) -> None:
        self.restart = True

    def _finish(self, finished: Seq[int]) -> None:
        if self.restart:  # the first step after a failed one: drop what is held
            self.restart = False
            self.held.clear()
            self.rows.clear()
        leaving = set(finished)
        unknown = sorted(leaving - self.held.keys())
        assert not unknown, f"finished request ids {unknown} are not held"
        for rid in leaving:
            del self.held[rid]
            self.generated.pop(rid, None)
        self.rows = [rid for rid in self.rows if rid not in leaving]

    def _prefill_tokens(self, request: pb.PrefillRequest) -> tuple[int, list[int]]:
        """Apply ``request``: tokens it computes, and the ids whose prompt it completes
        (a mixed step's rows, those held before it, go to ``stepping``)."""
        self._finish(request.finished_request_ids)
        self.stepping = list(self.rows) if request.decode else []
        tokens, completed = 0, []
        for c in request.cached_requests:
            held = self.held[c.id]
            end = held[1] if c.num_tokens == 0 else held[0] + c.num_tokens
            tokens, held[0] = tokens + end - held[0], end
            if end == held[1]:
                completed.append(c.id)
        for r in request.new_requests:
            assert r.id not in self.held, f"new request {r.id} is held"
            total = len(r.input_ids)
            end = total if r.num_tokens == 0 else min(r.cache_len + r.num_tokens, total)
            self.held[r.id] = [end, total]
            tokens += end - r.cache_len
            if end == total:
                completed.append(r.id)
        self.rows.extend(completed)
        return tokens, completed

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        _, completed = self._prefill_tokens(request)
        return self._prefill_response(request, completed)

    def _prefill_response(self, request: pb.PrefillRequest,
                          completed: list[int]) -> pb.PrefillResponse:
        """First tokens of ``completed``; a mixed step's rows' tokens first."""
        rows = self.stepping  # chosen before the first tokens, as a shard samples them
        decoded = pb.DecodeResponse(token_ids=[self._next(rid) for rid in rows],
                                    logprobs=[-0.5] * len(rows)) if request.decode else None
        return pb.PrefillResponse(generations=[
            pb.Generation(request_id=rid, token_id=self._next(rid), logprob=-0.5)
            for rid in completed], decode=decoded)

    async def decode(self, request: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        self._finish(request.finished_request_ids)
        assert len(self.rows) == num_rows, f"{len(self.rows)} rows, the router says {num_rows}"
        return pb.DecodeResponse(token_ids=[self._next(rid) for rid in self.rows],
                                 logprobs=[-0.5] * len(self.rows), step=request.step)

    async def health(self) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class TimedShards(InstantShards):
    """A virtual device: calls run one after another in the order they arrive, each
    from the later of its arrival and the previous call's end; a Decode takes
    ``step_s`` seconds of wall time, a Prefill ``step_s`` plus ``prefill_token_s`` per
    prompt token it computes."""

    step_s: float = 0.0
    prefill_token_s: float = 0.0
    busy_until: float = 0.0

    async def _occupy(self, seconds: float) -> None:
        now = time.perf_counter()
        self.busy_until = max(now, self.busy_until) + seconds
        await asyncio.sleep(self.busy_until - now)

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        tokens, completed = self._prefill_tokens(request)
        response = self._prefill_response(request, completed)
        await self._occupy(self.step_s + tokens * self.prefill_token_s)
        return response

    async def decode(self, request: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        response = await super().decode(request, num_rows)
        await self._occupy(self.step_s)
        return response


@dataclass(frozen=True)
class Setup:
    """What every row shares: the virtual device's step (0: answer at once), whether it
    sits behind gRPC in a shard process of its own (:mod:`benchmarks.steps.virtual_shard`),
    the router's steps in flight, and the router's step trace (the gRPC shard's goes to
    the same folder)."""

    device_s: float = 0.0
    grpc: bool = False
    steps_in_flight: int = 1
    trace: Trace = field(default_factory=NullTrace)


@contextlib.asynccontextmanager
async def open_engine(tokenizer: Tokenizer, requests: int, new_tokens: int,
                      setup: Setup) -> AsyncIterator[Engine]:
    """A started engine over the shards ``setup`` asks for; stopped (and the shard
    process ended) on exit."""
    num_blocks = requests * (new_tokens // 16 + 4)
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=new_tokens + 64,
                             max_batch_prefill_tokens=max(requests * 64, 4096),
                             max_batch_size=requests, max_concurrent_requests=requests,
                             steps_in_flight=setup.steps_in_flight)
    process = None
    try:
        if setup.grpc:
            port = free_port()
            trace = setup.trace
            trace_dir = str(trace.path.parent) if isinstance(trace, StepTrace) else ""
            process = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.steps.virtual_shard", "--port", str(port),
                 "--step-ms", str(setup.device_s * 1e3), "--step-trace-dir", trace_dir],
                cwd=REPO_ROOT)
            client = ShardClient([f"127.0.0.1:{port}"], trace=setup.trace)
            await client.wait_ready(60.0)
            await client.warmup(config.max_batch_prefill_tokens, config.max_total_tokens)
            shards: Any = client
        else:
            ids = tokenizer.encode(TEXT, add_special_tokens=False)
            shards = (TimedShards(ids, num_blocks, step_s=setup.device_s) if setup.device_s
                      else InstantShards(ids, num_blocks))
        engine = Engine(shards, tokenizer, config, num_blocks, 16, setup.trace)
        engine.start()
        try:
            yield engine
        finally:
            await engine.stop()
    finally:  # also when the shard failed to start or warm up: never left running
        if process is not None:
            process.terminate()
            process.wait()


@dataclass(frozen=True)
class StepCost:
    """Per decode step of one run: the process's CPU seconds (CPU rather than wall time,
    so that other processes on the machine count less) and the step period the router
    sees (its mean time between two decode results, as in the server's
    ``decode_step_wall_seconds``); over the run, the garbage collector's full
    (generation 2) collections, the longest of them and all its pauses together,
    seconds."""

    cpu_s: float
    period_s: float
    full_collections: int = 0
    longest_full_s: float = 0.0
    collecting_s: float = 0.0


class CollectorPauses:
    """The cyclic garbage collector's pauses while in use (``gc.callbacks``): each
    collection stops the event loop, and with it the next step's send."""

    def __init__(self) -> None:
        self.full = 0
        self.longest_full_s = 0.0
        self.total_s = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.total_s += pause
        if info["generation"] == 2:
            self.full += 1
            self.longest_full_s = max(self.longest_full_s, pause)

    def cost(self, cost: StepCost) -> StepCost:
        """``cost`` with this run's collections."""
        return dataclasses.replace(cost, full_collections=self.full,
                                   longest_full_s=self.longest_full_s,
                                   collecting_s=self.total_s)

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def step_cost(engine: Engine, cpu_s: float, new_tokens: int) -> StepCost:
    """The run's cost per step from its CPU seconds and the engine's step metric."""
    samples = {s.name: s.value for metric in engine.metrics.decode_step_wall.collect()
               for s in metric.samples}
    period = samples["shardserve_decode_step_wall_seconds_sum"] / max(
        samples["shardserve_decode_step_wall_seconds_count"], 1)
    return StepCost(cpu_s / new_tokens, period)


async def run_engine(tokenizer: Tokenizer, requests: int, new_tokens: int, stream: bool,
                     setup: Setup) -> StepCost:
    """One run of the engine alone; the cost per step is the run's over ``new_tokens``."""
    async with open_engine(tokenizer, requests, new_tokens, setup) as engine:
        return await _run_engine(engine, tokenizer, requests, new_tokens, stream)


async def _run_engine(engine: Engine, tokenizer: Tokenizer, requests: int, new_tokens: int,
                      stream: bool) -> StepCost:
    prompt = tuple(tokenizer.encode("Hello there, how are you today?"))

    async def one() -> int:
        request = GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True), stream=stream,
        )
        return sum([1 async for _ in engine.generate(request)])

    gc.collect()
    gc.freeze()  # as the server does once started
    with CollectorPauses() as pauses:
        started = time.process_time()
        counts = await asyncio.gather(*(one() for _ in range(requests)))
        cost = step_cost(engine, time.process_time() - started, new_tokens)
    assert counts == [new_tokens] * requests, counts
    return pauses.cost(cost)


CLIENT = """
import asyncio, json, sys
import httpx

async def main(url, requests, new_tokens, stream):
    body = {"model": "m", "prompt": "Hello there, how are you today?",
            "max_tokens": new_tokens, "ignore_eos": True, "stream": stream,
            "temperature": 0}
    limits = httpx.Limits(max_connections=requests + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one():
            if not stream:
                response = await client.post(url, json=body)
                return response.json()["usage"]["completion_tokens"]
            chunks = 0
            async with client.stream("POST", url, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
            return chunks
        counts = await asyncio.gather(*(one() for _ in range(requests)))
    print(json.dumps(counts))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"))
"""


async def run_http(tokenizer: Tokenizer, requests: int, new_tokens: int, stream: bool,
                   setup: Setup) -> StepCost:
    """One run of the serving process over HTTP; cost per step as :func:`run_engine`."""
    async with open_engine(tokenizer, requests, new_tokens, setup) as engine:
        validator = Validator(tokenizer, engine.scheduler, ValidationLimits())
        state = ServerState(engine=engine, validator=validator, model_id="m",
                            dtype="bfloat16", device_type="cuda", num_shard=1,
                            attention_backend="triton", version="bench")
        port = free_port()
        server = make_http_server(create_app(state), "127.0.0.1", port, 30.0, 1)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        gc.collect()
        gc.freeze()  # as the server does once started
        with CollectorPauses() as pauses:
            started = time.process_time()
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}/v1/completions",
                str(requests), str(new_tokens), "1" if stream else "0",
                stdout=subprocess.PIPE)
            out, _ = await client.communicate()
            cost = step_cost(engine, time.process_time() - started, new_tokens)
        cost = pauses.cost(cost)
        server.should_exit = True
        await serving
    counts = json.loads(out)
    # streamed: one chunk per token (the last also carries the finish)
    assert counts == [new_tokens] * requests, counts
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--modes", nargs="+", choices=("engine", "http"),
                        default=["engine", "http"])
    parser.add_argument("--streaming", nargs="+", choices=("yes", "no"), default=["yes", "no"])
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="a virtual device taking this long per step (0: none)")
    parser.add_argument("--steps-in-flight", type=int, nargs="+", default=[1])
    parser.add_argument("--shards", nargs="+", choices=("local", "grpc"), default=["local"],
                        help="grpc: the virtual device in a shard process behind gRPC")
    parser.add_argument("--step-trace-dir", default=os.environ.get("STEP_TRACE_DIR", ""),
                        metavar="DIR", help="the router and the gRPC shard append their "
                        "step timestamps here (default: $STEP_TRACE_DIR; none)")
    args = parser.parse_args()
    trace = step_trace(args.step_trace_dir)
    from loguru import logger

    logger.remove()  # one log line per request would be measured too
    tokenizer = Tokenizer.from_folder(args.tokenizer)
    print(header("router step cost", "cpu"))
    if args.device_ms:
        print(f"virtual device: {args.device_ms:g} ms per step")
    print("| mode | shards | requests | streaming | steps in flight | CPU ms per step | "
          "CPU µs per token | step period, ms | full collections | longest full, ms | "
          "collecting, ms per run |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    runners = {"engine": run_engine, "http": run_http}
    for mode in args.modes:
        for requests in args.requests:
            for streaming in args.streaming:
                for shards, in_flight in itertools.product(args.shards,
                                                           args.steps_in_flight):
                    if shards == "grpc" and not args.device_ms:
                        parser.error("--shards grpc needs --device-ms")
                    setup = Setup(args.device_ms / 1e3, shards == "grpc", in_flight, trace)
                    runs = [asyncio.run(runners[mode](tokenizer, requests, args.new_tokens,
                                                      streaming == "yes", setup))
                            for _ in range(args.repeats)]
                    cpu_s = min(run.cpu_s for run in runs)
                    period_s = min(run.period_s for run in runs)
                    full = max(run.full_collections for run in runs)
                    longest = max(run.longest_full_s for run in runs)
                    collecting = min(run.collecting_s for run in runs)
                    print(f"| {mode} | {shards} | {requests} | {streaming} | {in_flight} | "
                          f"{cpu_s * 1e3:.2f} | {cpu_s / requests * 1e6:.1f} | "
                          f"{period_s * 1e3:.2f} | {full} | {longest * 1e3:.1f} | "
                          f"{collecting * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
