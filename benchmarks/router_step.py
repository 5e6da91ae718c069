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

    python benchmarks/router_step.py --requests 1 64 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from router.api.app import create_app
from router.api.http_server import make_http_server
from router.api.state import ServerState
from router.config import SchedulerConfig, ValidationLimits
from router.engine import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer
from router.validation import Validator
from shard.pb import shard_pb2 as pb

DEFAULT_TOKENIZER = Path.home() / ".cache/shardserve/models/SmolLM2-135M-Instruct"
TEXT = " The quick brown fox jumps over the lazy dog, and then it runs away."


@dataclass
class InstantShards:
    """A shard group that answers every call at once: each request emits ``ids``
    cyclically."""

    ids: list[int]
    num_blocks: int
    block_size: int = 16
    generated: dict[int, int] = field(default_factory=dict)

    def _next(self, request_id: int) -> int:
        count = self.generated.get(request_id, 0)
        self.generated[request_id] = count + 1
        return self.ids[count % len(self.ids)]

    async def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        kept = [r.id for r in batch.requests if not r.partial]
        generations = [pb.Generation(request_id=rid, token_id=self._next(rid), logprob=-0.5)
                       for rid in kept]
        return pb.PrefillResponse(generations=generations,
                                  batch=pb.CachedBatch(id=batch.id, request_ids=kept))

    async def decode(self, batches: list[pb.CachedBatch], block_appends: dict[int, list[int]],
                     remove_request_ids: Seq[int] = ()) -> pb.DecodeResponse:
        removed = set(remove_request_ids)
        ids = [rid for b in batches for rid in b.request_ids if rid not in removed]
        return pb.DecodeResponse(batch=pb.CachedBatch(id=batches[0].id, request_ids=ids),
                                 token_ids=[self._next(rid) for rid in ids],
                                 logprobs=[-0.5] * len(ids))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        return pb.CachedBatch(id=batch_id, request_ids=request_ids)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        return None

    async def health(self) -> None:
        return None

    async def close(self) -> None:
        return None


def make_engine(tokenizer: Tokenizer, requests: int, new_tokens: int) -> Engine:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    shards = InstantShards(ids, num_blocks=requests * (new_tokens // 16 + 4))
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=new_tokens + 64,
                             max_batch_prefill_tokens=max(requests * 64, 4096),
                             max_batch_size=requests, max_concurrent_requests=requests)
    return Engine(shards, tokenizer, config, shards.num_blocks,  # type: ignore[arg-type]
                  shards.block_size)


async def run_engine(tokenizer: Tokenizer, requests: int, new_tokens: int,
                     stream: bool) -> float:
    """CPU seconds of this process per decode step (the run's CPU time / ``new_tokens``;
    CPU time rather than wall time, so that other processes on the machine count less).
    """
    engine = make_engine(tokenizer, requests, new_tokens)
    engine.start()
    prompt = tuple(tokenizer.encode("Hello there, how are you today?"))

    async def one() -> int:
        request = GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True), stream=stream,
        )
        return sum([1 async for _ in engine.generate(request)])

    started = time.process_time()
    counts = await asyncio.gather(*(one() for _ in range(requests)))
    elapsed = time.process_time() - started
    await engine.stop()
    assert counts == [new_tokens] * requests, counts
    return elapsed / new_tokens


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


async def run_http(tokenizer: Tokenizer, requests: int, new_tokens: int, stream: bool) -> float:
    """CPU seconds of the serving process per decode step, over HTTP."""
    engine = make_engine(tokenizer, requests, new_tokens)
    validator = Validator(tokenizer, engine.scheduler, ValidationLimits())
    state = ServerState(engine=engine, validator=validator, model_id="m", dtype="bfloat16",
                        device_type="cuda", num_shard=1, attention_backend="triton",
                        version="bench")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = make_http_server(create_app(state), "127.0.0.1", port, 30.0, 1)
    engine.start()
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    started = time.process_time()
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}/v1/completions",
        str(requests), str(new_tokens), "1" if stream else "0", stdout=subprocess.PIPE)
    out, _ = await client.communicate()
    elapsed = time.process_time() - started
    server.should_exit = True
    await serving
    await engine.stop()
    counts = json.loads(out)
    # streamed: one chunk per token (the last also carries the finish)
    assert counts == [new_tokens] * requests, counts
    return elapsed / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--modes", nargs="+", choices=("engine", "http"),
                        default=["engine", "http"])
    args = parser.parse_args()
    from loguru import logger

    logger.remove()  # one log line per request would be measured too
    tokenizer = Tokenizer.from_folder(args.tokenizer)
    print(f"router step cost, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print("| mode | requests | streaming | CPU ms per step | CPU µs per token |")
    print("|---|---:|---|---:|---:|")
    runners = {"engine": run_engine, "http": run_http}
    for mode in args.modes:
        for requests in args.requests:
            for stream in (True, False):
                step_s = min(
                    asyncio.run(runners[mode](tokenizer, requests, args.new_tokens, stream))
                    for _ in range(args.repeats)
                )
                print(f"| {mode} | {requests} | {'yes' if stream else 'no'} | "
                      f"{step_s * 1e3:.2f} | {step_s / requests * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
