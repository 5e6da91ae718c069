"""Block-table locality on the CPU path: how often the router's allocator gives a running
sequence one run of consecutive block ids, and what that saves a CPU decode step.

The CPU attention (``TorchAttentionBackend``'s by-sequence path) reads a sequence whose
blocks are consecutive ids in place and copies the blocks of any other sequence into a
packed buffer first, every layer. Two measurements, printed as markdown:

1. **Schedule** (no model): ``benchmarks/serving/cpu_serving.py``'s requests (its prompts, tokenized
   with the default model's tokenizer, ``--max-new-tokens`` each, ``--concurrency`` in
   flight, a new one admitted as one finishes) run through the real ``Scheduler`` and
   ``BlockManager``, once as they allocate and once with the allocation order of a plain
   FIFO free list (no reservation, no run search, no "next id"). Reported: the share of
   sequence-steps whose context lies in consecutive blocks, and of context tokens that
   would be gathered.
2. **Decode step** (``--steps`` > 0): the default model on the CPU, one thread, a batch of
   ``--concurrency`` sequences with the serving prompts' lengths, decoded with block
   tables of both layouts (each sequence's blocks consecutive; prompt blocks consecutive
   and the decode blocks interleaved across the sequences, as a FIFO pool hands them
   out); steps alternate between the two batches, medians reported with the time the
   gather of non-consecutive blocks takes per step.

    python -m benchmarks.simulations.block_locality [--concurrency 8] [--num-prompts 32] \\
        [--steps 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.harness import header
from benchmarks.serving.cpu_serving import make_prompts
from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.request import GenerationRequest, Sequence, StoppingParams
from router.scheduler import Scheduler
from shard.sampling_types import SamplingParams

BLOCK_SIZE = 16


class FifoBlockManager(BlockManager):
    """The allocation order of a plain FIFO free list, for comparison: blocks come from
    the front of the free list whatever the table they extend."""

    def _run_start(self, length: int) -> int | None:
        return None

    def _take_next(self, previous: int) -> int | None:
        return None

    def _reserve(self, last: int | None, count: int) -> None:
        return None


def schedule_locality(prompt_lens: list[int], concurrency: int, max_new_tokens: int,
                      manager: BlockManager) -> tuple[float, float]:
    """Run the requests through a scheduler over ``manager``, one decode step per
    iteration (every running sequence gains a token); returns (share of sequence-steps
    whose context blocks are consecutive ids, share of context tokens in the others)."""
    config = SchedulerConfig(max_batch_prefill_tokens=4096, max_batch_size=64,
                             max_input_tokens=2048, max_total_tokens=4096,
                             max_concurrent_requests=len(prompt_lens))
    scheduler = Scheduler(config, manager)
    sequences = [
        Sequence(id=i, request=GenerationRequest(
            input_ids=tuple(1000 * i + j for j in range(n)), sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=max_new_tokens)))
        for i, n in enumerate(prompt_lens)]
    pending = list(reversed(sequences))
    in_flight = steps = in_place = tokens = gathered = 0
    while pending or scheduler.num_requests:
        while in_flight < concurrency and pending:
            scheduler.add(pending.pop())
            in_flight += 1
        for chunk in scheduler.schedule_prefill():
            scheduler.on_prefilled(chunk)
            if not chunk.partial:
                chunk.seq.output_ids.append(0)  # the token sampled by the prefill
        running = list(scheduler.running)
        scheduler.plan_decode()
        for seq in running:
            blocks = seq.block_ids[: -(-seq.num_tokens // BLOCK_SIZE)]
            steps += 1
            tokens += seq.num_tokens
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                in_place += 1
            else:
                gathered += seq.num_tokens
            seq.output_ids.append(0)
        for seq in running:
            if len(seq.output_ids) >= max_new_tokens:
                scheduler.finish(seq)
                in_flight -= 1
    manager.check_integrity()
    return in_place / max(steps, 1), gathered / max(tokens, 1)


def _tables(prompt_lens: list[int], first: int, growth: int,
            interleaved: bool) -> tuple[list[list[int]], int]:
    """Block tables for prompts of ``prompt_lens`` tokens plus ``growth`` blocks each,
    from block ``first`` on; returns (tables, next free block)."""
    tables, next_block = [], first
    for n in prompt_lens:
        count = -(-n // BLOCK_SIZE) + (0 if interleaved else growth)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    if interleaved:  # decode blocks handed out in turn, as a FIFO pool does
        for _ in range(growth):
            for table in tables:
                table.append(next_block)
                next_block += 1
    return tables, next_block


def decode_steps(prompt_lens: list[int], steps: int) -> dict[str, tuple[float, float]]:
    """Median ms per decode step and ms of block gathering per step, per table layout."""
    import torch
    from loguru import logger

    from router.model_files import prepare_default_model
    from shard.attention import torch_by_sequence
    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner
    from shard.records import NewRequest, PrefillStep
    from shard.requests import RequestTable

    logger.remove()
    torch.set_num_threads(1)
    runner = ModelRunner(ShardConfig(model_path=str(prepare_default_model().path),
                                     device="cpu", block_size=BLOCK_SIZE))
    runner.warmup(4096, 4096, len(prompt_lens))
    rng = random.Random(0)
    growth = -(-(steps + 24) // BLOCK_SIZE) + 1
    # NOTE: a decode step steps every request the runner holds; each layout's requests
    # are kept in a table of their own, put in place for its steps (no block is shared)
    layouts: dict[str, RequestTable] = {}
    next_block = 0
    for batch_id, name in enumerate(("consecutive", "interleaved"), start=1):
        tables, next_block = _tables(prompt_lens, next_block, growth, name == "interleaved")
        requests = tuple(
            NewRequest(100 * batch_id + i, tuple(rng.randrange(3, 40000) for _ in range(n)),
                       0, tuple(table), SamplingParams())
            for i, (n, table) in enumerate(zip(prompt_lens, tables, strict=True)))
        runner.requests = layouts[name] = RequestTable()
        runner.prefill(PrefillStep(requests))
    for _ in range(BLOCK_SIZE + 4):  # past the prompts' last blocks: decode blocks in use
        for held in layouts.values():
            runner.requests = held
            runner.decode()
    gather_s = 0.0
    buffers = torch_by_sequence.SequenceContexts.buffers

    def timed_buffers(self, kv_cache):  # type: ignore[no-untyped-def]
        nonlocal gather_s
        started = time.perf_counter()
        out = buffers(self, kv_cache)
        gather_s += time.perf_counter() - started
        return out

    torch_by_sequence.SequenceContexts.buffers = timed_buffers  # type: ignore[method-assign]
    walls: dict[str, list[float]] = {name: [] for name in layouts}
    gathers: dict[str, float] = dict.fromkeys(layouts, 0.0)
    try:
        for _ in range(steps):
            for name, held in layouts.items():
                runner.requests = held
                gather_before = gather_s
                started = time.perf_counter()
                runner.decode()
                walls[name].append((time.perf_counter() - started) * 1e3)
                gathers[name] += (gather_s - gather_before) * 1e3
    finally:
        torch_by_sequence.SequenceContexts.buffers = buffers  # type: ignore[method-assign]
    return {name: (statistics.median(walls[name]), gathers[name] / steps) for name in layouts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=60, help="decode steps per layout (0: none)")
    args = p.parse_args()
    from router.model_files import prepare_default_model
    from router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(prepare_default_model().path)
    prompt_lens = [len(tokenizer.encode(text)) for text in make_prompts(args.num_prompts, "c8")]
    print(header("Block-table locality", "cpu", "torch") + "\n")
    print(f"Schedule: {args.num_prompts} requests of {min(prompt_lens)}-{max(prompt_lens)} "
          f"prompt tokens, {args.max_new_tokens} new tokens each, {args.concurrency} in flight, "
          f"block size {BLOCK_SIZE}.\n")
    print("| allocator | sequence-steps read in place | context tokens gathered |")
    print("|---|---:|---:|")
    for name, manager_type in (("shardserve", BlockManager), ("FIFO free list", FifoBlockManager)):
        in_place, gathered = schedule_locality(prompt_lens, args.concurrency,
                                               args.max_new_tokens, manager_type(20000, BLOCK_SIZE))
        print(f"| {name} | {in_place:.0%} | {gathered:.0%} |")
    if args.steps:
        batch_lens = prompt_lens[: args.concurrency]
        print(f"\nDecode step, default model, CPU, one thread, batch {len(batch_lens)} "
              f"(prompts of {', '.join(map(str, batch_lens))} tokens), {args.steps} steps per "
              "layout, alternating:\n")
        print("| block tables | median step (ms) | block gather per step (ms) |")
        print("|---|---:|---:|")
        for name, (wall, gather) in decode_steps(batch_lens, args.steps).items():
            print(f"| {name} | {wall:.1f} | {gather:.2f} |")


if __name__ == "__main__":
    main()
