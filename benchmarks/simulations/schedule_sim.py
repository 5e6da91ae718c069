"""Scheduling policy on the GPU workloads without a GPU: the real engine and scheduler
over a virtual device whose step times were measured on the H200.

The workloads are those of ``benchmarks/serving/gpu_serving.py`` (same prompts and lengths);
the shard group is :class:`benchmarks.steps.router_step.TimedShards`: calls run one after
another, a Decode takes ``--decode-ms``, a Prefill that long plus ``--prefill-us-per-token``
per prompt token computed (defaults: the 8B-shaped Qwen3 on the H200, 2026-12-01:
~12 ms per decode step at 256-512 sequences, 375 ms per 16384-token prefill). Each
row runs every request at once through :meth:`Engine.generate` with one set of
scheduler flags and reports the wall time and output tokens/s; what differs between
rows is the policy alone. The router's own CPU time is real (this machine's).

    python -m benchmarks.simulations.schedule_sim --workloads prefill_heavy decode_heavy \\
        --waiting-served-ratio 0.3 0
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchmarks.harness import header
from benchmarks.serving.workloads import WORKLOAD_NAMES, Workload, build_workload
from benchmarks.steps.router_step import DEFAULT_TOKENIZER, TimedShards
from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import GenerationRequest, SamplingParams, StoppingParams
from router.tokenizer import Tokenizer

BLOCK_SIZE = 16


async def run(tokenizer: Tokenizer, workload: Workload, config: SchedulerConfig,
              decode_s: float, prefill_token_s: float) -> float:
    """Wall seconds to serve every request of ``workload`` at once."""
    blocks = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in
                 zip(workload.prompts, workload.output_lens, strict=True)) + 64
    shards = TimedShards(list(range(1000, 1050)), blocks, BLOCK_SIZE, step_s=decode_s,
                         prefill_token_s=prefill_token_s)
    engine = Engine(shards, tokenizer, config, blocks, BLOCK_SIZE)  # type: ignore[arg-type]
    engine.start()

    async def one(prompt: list[int], new_tokens: int) -> int:
        request = GenerationRequest(tuple(prompt), SamplingParams(),
                                    StoppingParams(max_new_tokens=new_tokens, ignore_eos=True))
        return sum([1 async for _ in engine.generate(request)])

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p, n) for p, n in
                                    zip(workload.prompts, workload.output_lens, strict=True)))
    wall = time.perf_counter() - started
    await engine.stop()
    assert counts == workload.output_lens, "a request did not get all its tokens"
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["bench", "prefill_heavy", "decode_heavy"],
                   choices=WORKLOAD_NAMES)
    p.add_argument("--waiting-served-ratio", type=float, nargs="+", default=[0.3, 0.0])
    p.add_argument("--max-waiting-tokens", type=int, default=20)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=16384)
    p.add_argument("--max-batch-size", type=int, default=512)
    p.add_argument("--decode-ms", type=float, default=12.0)
    p.add_argument("--prefill-us-per-token", type=float, default=22.2)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = p.parse_args()
    from loguru import logger

    logger.remove()
    tokenizer = Tokenizer.from_folder(args.tokenizer)
    print(header(f"scheduling on a virtual device ({args.decode_ms:g} ms per decode step, "
                 f"{args.prefill_us_per_token:g} µs per prefill token)", "cpu"))
    print("| workload | waiting served ratio | max waiting tokens | wall (s) | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name in args.workloads:
        workload = build_workload(name, args.vocab)
        longest = max(len(p) + n for p, n in
                      zip(workload.prompts, workload.output_lens, strict=True))
        for ratio in args.waiting_served_ratio:
            config = SchedulerConfig(
                max_batch_prefill_tokens=args.max_batch_prefill_tokens,
                max_batch_size=args.max_batch_size, max_input_tokens=longest,
                max_total_tokens=longest + 1, max_concurrent_requests=len(workload.prompts),
                waiting_served_ratio=ratio, max_waiting_tokens=args.max_waiting_tokens,
            )
            wall = asyncio.run(run(tokenizer, workload, config, args.decode_ms / 1e3,
                                   args.prefill_us_per_token / 1e6))
            print(f"| {name} | {ratio:g} | {args.max_waiting_tokens} | {wall:.2f} | "
                  f"{workload.output_tokens / wall:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
