"""The shard's host work per decode step: :meth:`ModelRunner.launch_decode` then
:meth:`ModelRunner.finish_step`, with the forward replaced by a fixed logits tensor,
so that what is timed is the Python around the forward (step checks, sampling choice,
block appends, token bookkeeping, the results), not the model.

On a GPU this work overlaps the previous step's compute only while it is shorter than
the step; with the router's work and gRPC both ways it is the chain that must fit in one
device step (see ``benchmarks/steps/router_step.py --device-ms``). Greedy requests of
``--prompt-len`` random tokens, a tiny Qwen3 config, the CPU; best of ``--repeats``
runs of ``--steps`` steps.

    python -m benchmarks.steps.shard_step --batch 1 64 256
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import header
from benchmarks.steps.dummy_model import BLOCK, QWEN3_8B_SHAPE, prefill_requests
from shard.config import ShardConfig
from shard.model_runner import ModelRunner

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}


def host_step_s(runner: ModelRunner, batch: int, prompt_len: int, steps: int,
                repeats: int) -> float:
    """Best mean seconds per launch + finish over ``repeats`` runs of ``steps`` steps."""
    prefill_requests(runner, batch, prompt_len, steps * repeats + 8)
    runner.decode()
    logits = torch.randn(batch, runner.model_config.vocab_size)
    runner.decode_logits = lambda rows, max_seqlen_k: logits  # type: ignore[method-assign]
    try:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(steps):
                runner.finish_step(runner.launch_decode())
            best = min(best, (time.perf_counter() - started) / steps)
    finally:
        del runner.decode_logits
        runner.reset()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from loguru import logger

    logger.remove()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps({**QWEN3_8B_SHAPE, **TINY}))
        runner = ModelRunner(ShardConfig(model_path=folder, device="cpu", block_size=BLOCK,
                                         dtype="float32", load_format="dummy"))
        runner.warmup(8192, 8192, max(args.batch))
        print(header("shard host work per decode step", "cpu", "torch"))
        print("| batch | µs per step | µs per request |")
        print("|---:|---:|---:|")
        for batch in args.batch:
            s = host_step_s(runner, batch, args.prompt_len, args.steps, args.repeats)
            print(f"| {batch} | {s * 1e6:.0f} | {s * 1e6 / batch:.2f} |", flush=True)


if __name__ == "__main__":
    main()
