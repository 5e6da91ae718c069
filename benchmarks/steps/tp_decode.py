"""Tensor-parallel decode benchmark and TP=1 vs TP=N greedy check, on plain processes
joined by torch.distributed (NCCL on GPUs, gloo on CPU) — no Ray, no gRPC.

1. check: a tiny random fp32 Llama (transformers, seeded) greedy-decoded at TP=1 and
   TP=N; the tokens must be identical (exit code 1 otherwise).
2. timing: a Llama-3-8B-shaped config.json with dummy weights (``load_format=dummy``,
   bf16 on GPU), decode step time (ModelRunner.decode: forward + all-reduces +
   sampling, host overhead included) at each TP size and batch size, median of
   ``--steps`` steps after 3 warm-up steps, prompts of ``--prompt-len`` random tokens.

Prints a markdown table (device, versions, date) and writes it to ``--out``.

    NCCL_NVLS_ENABLE=0 python -m benchmarks.steps.tp_decode --tp 1 2 --batch 1 32 128
    python -m benchmarks.steps.tp_decode --device cpu --tp 1 2 --batch 1 4 --small   # logic check
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import device_name, free_port, today, versions
from benchmarks.steps.dummy_model import BLOCK, LLAMA3_8B, SMALL, Blocks, prefill_requests
from shard.config import ShardConfig
from shard.distributed import destroy_distributed
from shard.model_runner import ModelRunner
from shard.records import NewRequest, PrefillStep
from shard.sampling_types import SamplingParams


def _runner(args: argparse.Namespace, model: str, rank: int, tp: int, port: int,
            dtype: str, dummy: bool, graphs: str) -> ModelRunner:
    return ModelRunner(ShardConfig(
        model_path=model, device=args.device, dtype=dtype, block_size=BLOCK,
        kv_cache_bytes=256 << 20, gpu_memory_fraction=0.85, rank=rank, world_size=tp,
        master_addr="127.0.0.1", master_port=port, load_format="dummy" if dummy else "safetensors",
        attention_backend=args.attention_backend, cuda_graphs=graphs,
    ))


def _greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    blocks = Blocks()
    reqs = tuple(
        NewRequest(i, tuple(p), 0, blocks.take(len(p) + new_tokens), SamplingParams())
        for i, p in enumerate(prompts)
    )
    out = runner.prefill(PrefillStep(reqs))
    tokens = {g.request_id: [g.token_id] for g in out.generations}
    for _ in range(new_tokens - 1):
        for g in runner.decode().generations:
            tokens[g.request_id].append(g.token_id)
    runner.reset()
    return [tokens[i] for i in range(len(prompts))]


def _time_decode(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Median decode step time in ms for ``batch`` requests of ``prompt_len`` tokens."""
    prefill_requests(runner, batch, prompt_len, steps + 3, per=max(1, 4096 // prompt_len),
                     spare=1)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    times = []
    for step in range(steps + 3):
        sync()
        t0 = time.perf_counter()
        runner.decode()
        sync()
        if step >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    runner.reset()
    return statistics.median(times)


def _worker(args: argparse.Namespace, job: dict[str, Any], rank: int, port: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // job["tp"]))
    runner = _runner(args, job["model"], rank, job["tp"], port, job["dtype"], job["dummy"],
                     job["graphs"])
    runner.warmup(4096, 2048, max(args.batch))
    if job["kind"] == "check":
        result: Any = _greedy(runner, job["prompts"], job["new_tokens"])
    else:
        result = {b: _time_decode(runner, b, args.prompt_len, args.steps) for b in args.batch}
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(result))
    destroy_distributed()


def run_job(args: argparse.Namespace, job: dict[str, Any]) -> Any:
    """Run ``job`` on ``job['tp']`` spawned ranks; rank 0's JSON result."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(args, job, r, port)) for r in range(job["tp"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if bad:
        raise RuntimeError(f"{job['kind']} at TP={job['tp']}: ranks exited with {bad}")
    return json.loads(Path(job["out"]).read_text())


def tiny_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.3)
    LlamaForCausalLM(config).float().save_pretrained(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--small", action="store_true", help="a small config instead of 8B")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cuda-graphs", nargs="+", default=["auto"],
                   help="decode modes to time side by side: 0 (eager), auto, or bucket lists")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    tiny, big = tmp / "tiny", tmp / "big"
    tiny_model(tiny)
    big.mkdir()
    cfg = SMALL if args.small else LLAMA3_8B
    (big / "config.json").write_text(json.dumps(cfg))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 7, 23, 40)]
    checks = {}
    modes = [(tp, g) for tp in args.tp for g in args.cuda_graphs]
    for tp, g in modes:
        job = dict(kind="check", tp=tp, model=str(tiny), dtype="float32", dummy=False,
                   prompts=prompts, new_tokens=16, out=str(tmp / f"check{tp}.json"), graphs=g)
        checks[(tp, g)] = run_job(args, job)
    same = all(checks[m] == checks[modes[0]] for m in modes)
    timings = {}
    bf = "bfloat16" if args.device.startswith("cuda") else "float32"
    for tp, g in modes:
        job = dict(kind="time", tp=tp, model=str(big), dtype=bf, dummy=True,
                   out=str(tmp / f"time{tp}.json"), graphs=g)
        timings[(tp, g)] = run_job(args, job)
    lines = [
        f"# Tensor-parallel decode step time ({'small' if args.small else 'Llama-3-8B'}-shaped, "
        f"dummy {bf} weights)",
        "",
        f"- date: {today()}; device: {device_name(args.device)} ×{max(args.tp)}; "
        f"{versions('torch')}"
        f"; NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if args.device != 'cpu' else '-'}"
        f"; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}",
        f"- prompts of {args.prompt_len} tokens, median of {args.steps} decode steps after 3 "
        "warm-up steps; ModelRunner.decode (forward, all-reduces, sampling, host work)",
        f"- greedy check, tiny fp32 Llama, 4 prompts × 16 tokens, every TP size and CUDA-graph "
        f"mode ({', '.join(f'TP={tp} graphs={g}' for tp, g in modes)}) identical: {same}",
        f"- attention backend: {args.attention_backend}; vocabulary {cfg['vocab_size']}",
        "",
        "| batch | " + " | ".join(f"TP={tp} graphs={g} (ms/step)" for tp, g in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for b in args.batch:
        lines.append(f"| {b} | " + " | ".join(f"{timings[m][str(b)]:.2f}" for m in modes)
                     + " |")
    table = "\n".join(lines) + "\n"
    sys.stdout.write(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
