"""What grammar-constrained requests cost a decode batch.

For each batch size B and number k of constrained requests, decodes two batches of B
requests with the model runner (forward + mask + sampling, host work included, no
gRPC), one step of each in turn: one where all B are unconstrained (the control) and one
where k of the B follow a JSON schema. The difference is what the grammar costs the
step; the mask column is the host time spent building the k rows' token mask per step
(llguidance filling the bitmasks, then copying and unpacking them to the device). On
CPU the forward is synchronous, so this adds to the step; on a GPU the fill runs while
the device computes the step's forward. Rows with k = 0 run the control against itself:
the noise floor of the machine.

Prints a markdown table (device, versions, date) and writes it to ``--out``.

    python -m benchmarks.steps.grammar_decode --batch 8 32 --constrained 0 1 4 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import device_name, today, versions
from router.grammar import json_schema_grammar
from router.model_files import prepare_default_model
from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.records import NewRequest, PrefillStep
from shard.requests import RequestTable
from shard.sampling_types import SamplingParams

# Long-running JSON: an array of records, so constrained requests stay constrained for
# the whole measurement instead of finishing early.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "score", "tags"],
        "additionalProperties": False,
    },
}
PROMPT_LEN = 32
BLOCK_SIZE = 16


def make_runner(model: Path, device: str, dtype: str) -> ModelRunner:
    runner = ModelRunner(ShardConfig(model_path=str(model), device=device, dtype=dtype,
                                     block_size=BLOCK_SIZE, kv_cache_bytes=512 << 20,
                                     gpu_memory_fraction=0.5))
    runner.warmup(max_batch_prefill_tokens=2048, max_total_tokens=1024)
    return runner


def _batch(batch: int, constrained: int, first_block: int, blocks_each: int) -> list[NewRequest]:
    grammar = json_schema_grammar(SCHEMA)
    requests = []
    for i in range(batch):
        prompt = tuple(int(t) for t in torch.randint(100, 40000, (PROMPT_LEN,)))
        start = first_block + i * blocks_each
        requests.append(NewRequest(i, prompt, 0, tuple(range(start, start + blocks_each)),
                                   SamplingParams(), grammar=grammar if i < constrained else ""))
    return requests


def run(
    runner: ModelRunner, batch: int, constrained: int, steps: int
) -> tuple[float, float, float]:
    """Decode a control batch (all unconstrained) and a batch whose first
    ``constrained`` requests follow the JSON grammar, one step of each in turn (so load
    from other processes hits both alike).

    Returns:
        (control step, constrained-batch step, mask build per step), milliseconds,
        medians: on CPU the steps' process CPU time, on a GPU their wall time.
    """
    blocks_each = -(-(PROMPT_LEN + steps + 8) // BLOCK_SIZE)
    # NOTE: a decode step steps every request the runner holds; each batch is kept in a
    # table of its own, put in place for its steps (their KV blocks do not overlap)
    tables = {1: RequestTable(), 2: RequestTable()}
    runner.requests = tables[1]
    runner.prefill(PrefillStep(tuple(_batch(batch, 0, 0, blocks_each))))
    runner.requests = tables[2]
    runner.prefill(PrefillStep(tuple(_batch(batch, constrained, batch * blocks_each,
                                            blocks_each))))
    masks: list[float] = []
    token_mask = runner.grammars.token_mask

    def timed_mask(matchers, device):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = token_mask(matchers, device)
        if out is not None:
            masks.append(time.perf_counter() - t0)
        return out

    runner.grammars.token_mask = timed_mask  # type: ignore[method-assign]
    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    try:
        for _ in range(steps):
            for batch_id in (1, 2):
                runner.requests = tables[batch_id]
                t0, c0 = time.perf_counter(), time.process_time()
                runner.decode()
                if runner.device.type == "cuda":
                    torch.cuda.synchronize()
                times[batch_id].append(time.perf_counter() - t0)
                cpu[batch_id].append(time.process_time() - c0)
    finally:
        del runner.grammars.token_mask  # the method again
        runner.requests = RequestTable()
    if runner.device.type == "cpu":
        # NOTE: CPU time of the process (all its threads) is what a step costs; with one
        # torch thread (no idle threads spinning) it barely moves when other processes
        # compete for the cores, unlike wall time.
        times = cpu
    control = statistics.median(times[1][3:]) * 1e3
    mixed = statistics.median(times[2][3:]) * 1e3
    return control, mixed, statistics.median(masks[3:]) * 1e3 if masks else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the default model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--constrained", type=int, nargs="+", default=[0, 1, 4],
                        help="0 runs the control against itself: the noise floor")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: no spinning threads inflate CPU time)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model = args.model or prepare_default_model().path
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    runner = make_runner(model, args.device, dtype)
    torch.manual_seed(0)
    rows = []
    for batch in args.batch:
        for k in args.constrained:
            if k > batch:
                continue
            control, mixed, mask_ms = run(runner, batch, k, args.steps)
            rows.append(f"| {batch} | {k} | {control:.2f} | {mixed:.2f} | "
                        f"{mixed - control:+.2f} ({(mixed / control - 1) * 100:+.1f}%) | "
                        f"{mask_ms:.3f} |")
    device = device_name(args.device)
    if not args.device.startswith("cuda"):
        device += f", torch threads: {torch.get_num_threads()}"
    lines = [
        "# Decode step with grammar-constrained requests",
        "",
        f"- date: {today()}; device: {device}; model: {model.name} ({dtype})",
        f"- {versions('torch', 'llguidance')}",
        f"- {args.steps} steps of each batch in turn, medians after 3 warm-up steps ("
        + ("process CPU time per step: the machine is shared" if args.device == "cpu"
           else "wall time per step") + f"), prompts of {PROMPT_LEN} tokens, greedy; "
        "constrained requests follow a JSON schema (array of records)",
        "",
        "| batch | constrained | all unconstrained (ms) | k constrained (ms) | "
        "difference | mask build (ms/step) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    table = "\n".join(lines) + "\n"
    sys.stdout.write(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
