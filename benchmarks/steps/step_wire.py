"""Bytes on the router <-> shard wire per step: the protobuf size (``ByteSize()``) of each
Prefill and Decode request and response, as the router's own code builds them and a
shard's servicer answers them.

The real engine (scheduler, block manager, ``ShardSteps``, ``ShardClient``) runs
``--requests`` short greedy requests against a virtual shard process behind the real
gRPC server (:mod:`benchmarks.steps.virtual_shard`); every Prefill and Decode is recorded at
the client's gRPC stubs. Once all of them decode, one request of ``--prompt-tokens``
prompt tokens arrives; it is prefilled in chunks of ``--chunk-tokens`` tokens (the
prefill token budget), one run per value. The table gives the Decode request and
response sizes over the steps with exactly ``--requests`` rows, and the size of each
Prefill of the long request.

Only public pieces of the tree on ``sys.path`` are used (the engine, its config and the
shard client), so the same script measures an older tree of the project:

    python -m benchmarks.steps.step_wire --requests 256 --prompt-tokens 1024 \\
        --chunk-tokens 4096 256
    cd OLD_TREE && PYTHONPATH=$PWD:/path/to/this/tree python -m benchmarks.steps.step_wire

(``benchmarks`` has no ``__init__.py``: the older tree's folder and this one's make one
namespace package, so the older tree's ``router``, ``shard`` and virtual shard are
measured, with this tree's script.)
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google.protobuf

import router
from benchmarks.harness import free_port
from router.config import SchedulerConfig
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.shard_client import ShardClient
from router.tokenizer import Tokenizer

try:
    from router.engine.loop import Engine
except ImportError:  # a tree from before router/engine/ became a package
    from router.engine import Engine  # type: ignore[attr-defined, no-redef]

DEFAULT_TOKENIZER = Path.home() / ".cache/shardserve/models/SmolLM2-135M-Instruct"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Call:
    """One recorded Prefill or Decode: its method, request and response sizes (bytes,
    protobuf ``ByteSize()``) and, for a Decode, the rows it stepped."""

    method: str
    request_bytes: int
    response_bytes: int
    rows: int


@dataclass
class Recorder:
    """Every Prefill and Decode made through the stubs it wraps, in call order."""

    calls: list[Call] = field(default_factory=list)
    rows_seen: asyncio.Event = field(default_factory=asyncio.Event)
    rows_wanted: int = 0

    async def record(self, method: str, call: Callable[..., Awaitable[Any]], request: Any,
                     **kwargs: Any) -> Any:
        request_bytes = request.ByteSize()  # before the call: as sent
        response = await call(request, **kwargs)
        rows = len(response.token_ids) if method == "Decode" else 0
        self.calls.append(Call(method, request_bytes, response.ByteSize(), rows))
        if rows == self.rows_wanted:
            self.rows_seen.set()
        return response


class RecordingStub:
    """A shard stub whose Prefill and Decode calls go through a :class:`Recorder`; every
    other call is the stub's own."""

    def __init__(self, stub: Any, recorder: Recorder) -> None:
        self._stub = stub
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Prefill(self, request: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._recorder.record("Prefill", self._stub.Prefill, request, **kwargs)

    def Decode(self, request: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._recorder.record("Decode", self._stub.Decode, request, **kwargs)


@dataclass(frozen=True)
class Run:
    """One run's recorded calls: the Decodes with exactly the running requests' rows,
    and the Prefills of the long request, in order."""

    decodes: list[Call]
    long_prefills: list[Call]


async def run(tokenizer: Tokenizer, requests: int, new_tokens: int, prompt_tokens: int,
              chunk_tokens: int) -> Run:
    """``requests`` short requests of ``new_tokens`` tokens, then one of ``prompt_tokens``
    prompt tokens prefilled in chunks of ``chunk_tokens``, over a virtual gRPC shard."""
    config = SchedulerConfig(
        max_input_tokens=prompt_tokens + 64, max_total_tokens=prompt_tokens + 64 + new_tokens,
        max_batch_prefill_tokens=chunk_tokens, max_batch_size=requests + 1,
        max_concurrent_requests=requests + 1)
    num_blocks = (requests + 1) * ((config.max_total_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE)
    port = free_port()
    root = Path(router.__file__).resolve().parents[1]
    # NOTE: the measured tree's own virtual shard speaks its protocol; trees from before
    # benchmarks/steps/ kept it at benchmarks/virtual_shard.py
    module = ("benchmarks.steps.virtual_shard" if (root / "benchmarks/steps").is_dir()
              else "benchmarks.virtual_shard")
    shard = subprocess.Popen([sys.executable, "-m", module, "--port", str(port),
                              "--step-ms", "0"], cwd=root)
    try:
        client = ShardClient([f"127.0.0.1:{port}"])
        await client.wait_ready(60.0)
        await client.warmup(config.max_batch_prefill_tokens, config.max_total_tokens)
        recorder = Recorder(rows_wanted=requests)
        # NOTE: the stubs are the one place every Prefill and Decode passes, as sent
        stubs: Any = [RecordingStub(stub, recorder) for stub in client._stubs]
        client._stubs = stubs
        engine = Engine(client, tokenizer, config, num_blocks, BLOCK_SIZE)
        engine.start()
        try:
            short = tuple(tokenizer.encode("Hello there, how are you today?"))
            stopping = StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)
            running = [asyncio.ensure_future(_generate(engine, short, stopping))
                       for _ in range(requests)]
            await recorder.rows_seen.wait()
            first_long = len(recorder.calls)
            prompt = tuple(random.Random(0).randrange(1000, 30000) for _ in range(prompt_tokens))
            await _generate(engine, prompt, StoppingParams(max_new_tokens=4, ignore_eos=True))
            await asyncio.gather(*running)
        finally:
            await engine.stop()
        await client.close()
    finally:
        shard.terminate()
        shard.wait()
    return Run(
        decodes=[c for c in recorder.calls if c.method == "Decode" and c.rows == requests],
        long_prefills=[c for c in recorder.calls[first_long:] if c.method == "Prefill"])


async def _generate(engine: Engine, prompt: tuple[int, ...], stopping: StoppingParams) -> int:
    request = GenerationRequest(input_ids=prompt, sampling=SamplingParams(), stopping=stopping)
    return sum([1 async for _ in engine.generate(request)])


def _spread(values: list[int]) -> str:
    return (f"{min(values)} | {statistics.median(values):.0f} | {statistics.mean(values):.0f} | "
            f"{max(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="running requests")
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="tokens each running request generates")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="prompt of the request that arrives while they decode")
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[4096, 256],
                        help="prefill token budget (the chunk of chunked prefill), one run each")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = parser.parse_args()
    from loguru import logger

    logger.remove()
    tokenizer = Tokenizer.from_folder(args.tokenizer)
    print(f"router <-> shard bytes per step, tree {Path(router.__file__).parents[1]}, "
          f"Python {platform.python_version()}, protobuf {google.protobuf.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    runs = {chunk: asyncio.run(run(tokenizer, args.requests, args.new_tokens,
                                   args.prompt_tokens, chunk))
            for chunk in args.chunk_tokens}
    print(f"\nDecode at {args.requests} rows, bytes (min | median | mean | max over the steps; "
          f"block size {BLOCK_SIZE})\n")
    print("| prefill budget | steps | request min | median | mean | max | "
          "response min | median | mean | max |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for chunk, result in runs.items():
        decodes = result.decodes
        print(f"| {chunk} | {len(decodes)} | {_spread([c.request_bytes for c in decodes])} | "
              f"{_spread([c.response_bytes for c in decodes])} |")
    print(f"\nPrefill of one request of {args.prompt_tokens} prompt tokens while "
          f"{args.requests} decode, bytes per call\n")
    print("| prefill budget | call | request | response |")
    print("|---:|---:|---:|---:|")
    for chunk, result in runs.items():
        for i, call in enumerate(result.long_prefills, 1):
            print(f"| {chunk} | {i} of {len(result.long_prefills)} | {call.request_bytes} | "
                  f"{call.response_bytes} |")
        total = sum(c.request_bytes for c in result.long_prefills)
        print(f"| {chunk} | all | {total} | "
              f"{sum(c.response_bytes for c in result.long_prefills)} |")


if __name__ == "__main__":
    main()
