"""Router cost per decode step: the real engine, scheduler, detokenizer and stop checks
over a shard group that answers at once, so that all the time measured is the router's.

With overlapped scheduling the shards compute step N+1 while the router processes step
N; the GPU waits for the router only when this per-step cost exceeds the device's step
time (about 9–12 ms for Llama-3-8B dimensions at 256 sequences on an H200). Each row runs
``--requests`` requests of ``--new-tokens`` greedy tokens (``ignore_eos``) at once and
reads every event of every request, as the HTTP layer would.

    python benchmarks/router_step.py --requests 1 64 256
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from router.config import SchedulerConfig
from router.engine import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer
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


async def run(tokenizer: Tokenizer, requests: int, new_tokens: int, stream: bool) -> float:
    """CPU seconds of this process per decode step (the run's CPU time / ``new_tokens``;
    CPU time rather than wall time, so that other processes on the machine count less).
    """
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    shards = InstantShards(ids, num_blocks=requests * (new_tokens // 16 + 4))
    config = SchedulerConfig(max_input_tokens=64, max_total_tokens=new_tokens + 64,
                             max_batch_prefill_tokens=max(requests * 64, 4096),
                             max_batch_size=requests, max_concurrent_requests=requests)
    engine = Engine(shards, tokenizer, config, shards.num_blocks,  # type: ignore[arg-type]
                    shards.block_size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    from loguru import logger

    logger.remove()  # one log line per request would be measured too
    tokenizer = Tokenizer.from_folder(args.tokenizer)
    print(f"router step cost, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print("| requests | streaming | CPU ms per step | CPU µs per token |")
    print("|---:|---|---:|---:|")
    for requests in args.requests:
        for stream in (True, False):
            step_s = min(asyncio.run(run(tokenizer, requests, args.new_tokens, stream))
                         for _ in range(args.repeats))
            print(f"| {requests} | {'yes' if stream else 'no'} | {step_s * 1e3:.2f} | "
                  f"{step_s / requests * 1e6:.1f} |")


if __name__ == "__main__":
    main()
