"""The fixed serving workloads: token-id prompts and output lengths, built exactly as the
nano-vllm peer runner (``nano_vllm_bench.py``) builds them, so that both engines get the
same requests.

  bench          nano-vllm's bench.py: ``random.seed(0)``; 256 prompts of
                 ``randint(100, 1024)`` ids drawn with ``randint(0, 10000)``, then 256
                 output lengths ``randint(100, 1024)`` (the global ``random`` state)
  batch1         1 prompt of 128 ids (``random.Random(100)``, ids in [100, vocab)), 256 out
  prefill_heavy  512 prompts of 1024 ids (``random.Random(101)``), 128 out each
  decode_heavy   256 prompts of 128 ids (``random.Random(102)``), 512 out each
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Requests of one workload.

    Attributes:
        name: Workload name (a key of :data:`WORKLOAD_NAMES`).
        prompts: Token ids of each prompt.
        output_lens: Tokens to generate per request (EOS ignored), same order.
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def uniform(self) -> bool:
        """Every prompt has one length and every request one output length."""
        return len({len(p) for p in self.prompts}) == 1 and len(set(self.output_lens)) == 1

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (all when ``n`` <= 0)."""
        if n <= 0 or n >= len(self.prompts):
            return self
        return Workload(self.name, self.prompts[:n], self.output_lens[:n])

    def describe(self) -> str:
        """e.g. ``256 × 100–1024 in / 100–1024 out``."""

        def span(values: list[int]) -> str:
            lo, hi = min(values), max(values)
            return str(lo) if lo == hi else f"{lo}–{hi}"

        lens = [len(p) for p in self.prompts]
        return f"{len(self.prompts)} × {span(lens)} in / {span(self.output_lens)} out"


def _bench() -> tuple[list[list[int]], list[int]]:
    # NOTE: seeds and draws the module-level generator, as bench.py does; the order of
    # the draws (all prompts, then all output lengths) is part of the workload.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    return prompts, [random.randint(100, 1024) for _ in range(256)]


def _fixed(seed: int, n: int, in_len: int, out_len: int,
           vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(in_len)] for _ in range(n)], [out_len] * n


_FIXED = {"batch1": (100, 1, 128, 256), "prefill_heavy": (101, 512, 1024, 128),
          "decode_heavy": (102, 256, 128, 512)}
WORKLOAD_NAMES = ("bench", *_FIXED)


def build_workload(name: str, vocab: int) -> Workload:
    """The workload ``name`` for a model of ``vocab`` ids.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if name == "bench":
        return Workload(name, *_bench())
    if name not in _FIXED:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOAD_NAMES)}")
    return Workload(name, *_fixed(*_FIXED[name], vocab=vocab))


def distinct_prefix(workload: Workload, vocab: int) -> Workload:
    """The same requests with each prompt's first id moved by one (mod ``vocab``), so that
    a second pass over a workload finds none of the first pass's blocks in the prefix
    cache (block hashes chain from the first block) while every length stays the same."""
    prompts = [[(p[0] + 1) % vocab, *p[1:]] for p in workload.prompts]
    return Workload(workload.name, prompts, workload.output_lens)
