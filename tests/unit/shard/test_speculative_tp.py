"""Speculative Decodes at TP=2 (gloo, CPU): with the same scripted guesses on both
ranks (right for a random number of each row's first guesses, wrong after), rank 0 and
rank 1 emit the same tokens in the same steps, and those tokens are a 1-rank runner's
plain Decodes: greedy rows' and a seeded sampled row's."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from shard.distributed import destroy_distributed
from shard.model_runner import ModelRunner
from shard.records import NewRequest, PrefillStep
from shard.requests import RequestState
from shard.sampling_types import SamplingParams
from shard.speculative.step import SpeculativeDecoder
from tests.ports import unused_port
from tests.unit.shard.helpers import PROMPTS, BlockPool, DecodeDriver, make_runner, request
from tests.unit.shard.test_speculative_step import SpecDriver
from tests.unit.shard.tp_harness import POOL_BLOCKS, make_config, spawn_ranks

NEW_TOKENS = 16
K = 3
# the sampled row: PROMPTS[1] again, with a seed
SAMPLED = SamplingParams(do_sample=True, temperature=0.9, top_k=40, seed=21)
TIMEOUT_S = 300.0


def _requests(pool: BlockPool) -> list[NewRequest]:
    """The four PROMPTS greedy, and PROMPTS[1] sampled (request ids 0-4)."""
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(PROMPTS)]
    p = PROMPTS[1]
    reqs.append(request(len(PROMPTS), p, pool.for_tokens(len(p)), sampling=SAMPLED))
    return reqs


class PartlyRightProposer:
    """Guesses ``truth[request id]`` (the row's reference continuation): right for the
    first r guesses of each row and step, r drawn from 0..budget, and wrong after. The
    draws are seeded, so every rank makes the same guesses."""

    def __init__(self, truth: dict[int, list[int]], seed: int = 0) -> None:
        self.truth = truth
        self.rng = random.Random(seed)

    def propose(self, requests: Sequence[RequestState], budgets: Sequence[int]) -> list[list[int]]:
        out = []
        for r, budget in zip(requests, budgets, strict=True):
            want = self.truth[r.request_id][r.num_generated : r.num_generated + budget]
            right = self.rng.randrange(len(want) + 1)
            out.append(want[:right] + [(t + 1) % 256 for t in want[right:]])
        return out

    def draft_probs(self) -> None:
        """The guesses are deterministic (as n-gram ones)."""
        return None


def plain_tokens(runner: ModelRunner) -> dict[int, list[int]]:
    """Each request's first NEW_TOKENS tokens from plain Decodes."""
    pool = BlockPool(POOL_BLOCKS, seed=5)
    out: dict[int, list[int]] = {}
    for g in runner.prefill(_prefill(pool)).generations:
        out[g.request_id] = [g.token_id]
    driver = DecodeDriver(runner, pool)
    for _ in range(NEW_TOKENS - 1):
        for rid, tok in driver.step().items():
            out[rid].append(tok)
    return out


def _prefill(pool: BlockPool) -> PrefillStep:
    return PrefillStep(tuple(_requests(pool)))


def speculative_tokens(
    runner: ModelRunner, truth: dict[int, list[int]]
) -> tuple[dict[int, list[int]], list[list[int]]]:
    """Each request's first NEW_TOKENS tokens from speculative Decodes of K guesses
    (:class:`PartlyRightProposer`), and the tokens each step emitted per row."""
    runner.speculator = SpeculativeDecoder(runner, PartlyRightProposer(truth))
    pool = BlockPool(POOL_BLOCKS, seed=5)
    out: dict[int, list[int]] = {}
    for g in runner.prefill(_prefill(pool)).generations:
        out[g.request_id] = [g.token_id]
    driver = SpecDriver(runner, pool, k=K)
    counts = []
    while min(len(t) for t in out.values()) < NEW_TOKENS:
        tokens, _, step_counts = driver.spec_step()
        for rid, toks in tokens.items():
            out[rid].extend(toks)
        counts.append(list(step_counts))
    return {rid: toks[:NEW_TOKENS] for rid, toks in out.items()}, counts


def _rank(
    model_dir: str, rank: int, world_size: int, port: int, truth: dict[int, list[int]], out: str
) -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(make_config(Path(model_dir), rank, world_size, port))
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    tokens, counts = speculative_tokens(runner, truth)
    Path(f"{out}.rank{rank}").write_text(json.dumps({"tokens": tokens, "counts": counts}))
    destroy_distributed()


def run_ranks(
    model_dir: Path, world_size: int, truth: dict[int, list[int]], tmp: Path
) -> list[dict[str, Any]]:
    """:func:`speculative_tokens` on ``world_size`` ranks; every rank's result."""
    port, out = unused_port(), tmp / "spec"
    spawn_ranks(_rank, lambda r: (str(model_dir), r, world_size, port, truth, str(out)),
              world_size, TIMEOUT_S)
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world_size)]
    for result in results:  # JSON keys are strings
        result["tokens"] = {int(rid): toks for rid, toks in result["tokens"].items()}
    return results


@pytest.fixture(scope="module")
def tp1_plain(llama: tuple[Path, Any]) -> dict[int, list[int]]:
    return plain_tokens(make_runner(llama[0]))


def test_tp2_speculative_tokens_agree_across_ranks_and_equal_tp1_plain(
    llama: tuple[Path, Any], tp1_plain: dict[int, list[int]], tmp_path: Path
) -> None:
    ranks = run_ranks(llama[0], 2, tp1_plain, tmp_path)
    assert ranks[0] == ranks[1]  # the same tokens, step by step
    assert ranks[0]["tokens"] == tp1_plain
    counts = [c for step in ranks[0]["counts"] for c in step]
    # guesses were both accepted and rejected, so the check has teeth
    assert max(counts) > 1 and min(counts) == 1
