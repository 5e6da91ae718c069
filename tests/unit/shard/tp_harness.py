"""Run the same greedy scenario through :class:`ModelRunner` at any TP size: each rank
in its own spawned process joined by gloo on CPU; rank 0 saves its results."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shard.config import ShardConfig
from shard.distributed import destroy_distributed
from shard.inputs import SeqChunk
from shard.model_runner import ModelRunner
from tests.ports import unused_port
from tests.unit.shard.helpers import BLOCK_SIZE, BlockPool, DecodeDriver, prefill, request

POOL_BLOCKS = 512  # the same block ids at every TP size


def greedy_scenario(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """Full-prompt logits of all prompts in one forward, then greedy tokens for three
    batch compositions: each prompt alone, all in one step, and prompts joining the
    running rows at different steps (and leaving once they have ``new_tokens``)."""
    pool = BlockPool(POOL_BLOCKS, seed=7)
    chunks = [SeqChunk(p, 0, pool.for_tokens(len(p))) for p in prompts]
    with torch.inference_mode():
        _, hidden = runner.run_chunks(chunks, is_prefill=True)
        logits = runner.model.compute_logits(hidden).cpu()  # [sum(len(p)), vocab]
    driver = DecodeDriver(runner, pool)
    alone = []
    for i, p in enumerate(prompts):
        tokens = [prefill(runner, request(i, p, pool.for_tokens(len(p))))[i]]
        while len(tokens) < new_tokens:
            tokens.append(driver.step()[i])
        assert driver.step(finished=(i,)) == {}
        alone.append(tokens)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(prompts)]
    together = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    for _ in range(new_tokens - 1):
        for rid, tok in driver.step().items():
            together[rid].append(tok)
    assert driver.step(finished=tuple(together)) == {}
    joined: dict[int, list[int]] = {}
    leaving: tuple[int, ...] = ()
    for step in range(new_tokens + len(prompts)):
        if step < len(prompts):
            p = prompts[step]
            first = prefill(runner, request(step, p, pool.for_tokens(len(p))), finished=leaving)
            leaving = ()
            joined[step] = [first[step]]
        out = driver.step(finished=leaving)
        for rid, tok in out.items():
            joined[rid].append(tok)
        leaving = tuple(rid for rid in out if len(joined[rid]) == new_tokens)
    assert len(runner.requests) == 0
    return {
        "logits": logits,
        "alone": alone,
        "together": [together[i] for i in range(len(prompts))],
        "joined": [joined[i] for i in range(len(prompts))],
    }


def grammar_scenario(runner: ModelRunner, grammars: list[str], new_tokens: int) -> list[list[int]]:
    """One step of a greedy request per grammar, the same grammars sampled, and one
    unconstrained request; the tokens of each (rank-local masks and matchers)."""
    from shard.sampling_types import SamplingParams

    pool = BlockPool(POOL_BLOCKS, seed=3)
    prompt = [1, 504, 3458, 314, 253, 1345, 28]
    specs = [*((g, SamplingParams()) for g in grammars),
             *((g, SamplingParams(do_sample=True, seed=9)) for g in grammars),
             ("", SamplingParams())]
    reqs = [request(i, prompt, pool.for_tokens(len(prompt) + new_tokens), sampling=sampling,
                    grammar=grammar) for i, (grammar, sampling) in enumerate(specs)]
    tokens = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for _ in range(new_tokens - 1):
        for rid, tok in driver.step().items():
            tokens[rid].append(tok)
    runner.reset()
    return [tokens[i] for i in range(len(specs))]


def make_config(model_dir: Path, rank: int, world_size: int, port: int,
                **overrides: Any) -> ShardConfig:
    return ShardConfig(
        model_path=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
        kv_cache_bytes=128 * 1024 * 1024, rank=rank, world_size=world_size,
        master_addr="127.0.0.1", master_port=port, **overrides,
    )


def _worker(model_dir: str, rank: int, world_size: int, port: int, prompts: list[list[int]],
            new_tokens: int, out: str, grammars: list[str] | None = None,
            overrides: dict[str, Any] | None = None) -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(make_config(Path(model_dir), rank, world_size, port,
                                     **(overrides or {})))
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    if grammars is not None:  # every rank reports: their tokens must agree
        torch.save(grammar_scenario(runner, grammars, new_tokens), f"{out}.rank{rank}")
    else:
        result = greedy_scenario(runner, prompts, new_tokens)
        if rank == 0:
            torch.save(result, out)
    destroy_distributed()



def spawn_ranks(target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]],
              world_size: int, timeout_s: float) -> None:
    """Run ``target(*args_of(rank))`` in one spawned process per rank and wait for all.

    Raises:
        AssertionError: a rank exited with an error or did not finish in ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout_s)
            assert p.exitcode == 0, f"a TP rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

def run_tp(model_dir: Path, world_size: int, prompts: list[list[int]], new_tokens: int,
           tmp: Path, timeout_s: float = 300.0, grammars: list[str] | None = None,
           overrides: dict[str, Any] | None = None) -> Any:
    """Run :func:`greedy_scenario` on ``world_size`` ranks; rank 0's results. With
    ``grammars``, :func:`grammar_scenario` instead; every rank's tokens, by rank.
    ``overrides``: further :class:`ShardConfig` fields of every rank.

    Raises:
        AssertionError: a rank exited with an error or did not finish in ``timeout_s``.
    """
    port = unused_port()
    out = tmp / f"tp{world_size}.pt"
    spawn_ranks(_worker, lambda r: (str(model_dir), r, world_size, port, prompts, new_tokens,
                                  str(out), grammars, overrides), world_size, timeout_s)
    if grammars is not None:
        return [torch.load(f"{out}.rank{r}") for r in range(world_size)]
    result: dict[str, Any] = torch.load(out)
    return result
