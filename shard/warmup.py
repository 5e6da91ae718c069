"""The pieces of warm-up that need no model: the worst-case prefill, the KV budget from
a measured memory profile, and the check that the cache holds the budgets. The phases
themselves run in :meth:`shard.model_runner.ModelRunner.warmup`.

CPU: ``num_blocks = kv_cache_bytes // bytes_per_block``.
CUDA: run the worst-case prefill with a temporary cache just big enough for it,
measure peak memory, then give the KV cache what is left of
``total × gpu_memory_fraction`` (the vLLM profiling approach).
Either way the real cache is then allocated and the worst-case prefill runs through it.
With decode CUDA graphs, their memory pool is measured by a capture over the temporary
cache and left out of the KV budget; the graphs are captured again over the real cache.
Each of these phases is announced (see shard/progress.py): warm-up can take tens of
seconds on a GPU and must not look like a hang.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard.errors import KVCacheTooSmallError
from shard.inputs import SeqChunk
from shard.sampling import SamplingRow
from shard.sampling_types import SamplingParams

# Phases shown while warming up (log lines, and a bar on rank 0's terminal).
WARMUP_PHASES = 3  # plus one for the decode CUDA graphs when there are any


def dummy_chunks(
    max_batch_prefill_tokens: int, max_total_tokens: int, block_size: int
) -> list[SeqChunk]:
    """Worst-case prefill: ``max_batch_prefill_tokens`` tokens split into sequences of at
    most ``max_total_tokens``, each on its own consecutive blocks starting at block 0."""
    chunks = []
    remaining, next_block = max_batch_prefill_tokens, 0
    while remaining > 0:
        n = min(remaining, max_total_tokens)
        blocks = -(-n // block_size)
        chunks.append(SeqChunk([0] * n, 0, list(range(next_block, next_block + blocks))))
        next_block += blocks
        remaining -= n
    return chunks


def blocks_needed(chunks: list[SeqChunk]) -> int:
    return sum(len(c.block_table) for c in chunks)


def dummy_sampling_rows(num_rows: int) -> list[SamplingRow]:
    """Sampling of the worst-case prefill: top-p, top-k and top-n logprobs, so every
    sampler path is allocated for."""
    return [
        SamplingRow(SamplingParams(do_sample=True, top_p=0.9, top_k=50), top_n=5)
        for _ in range(num_rows)
    ]


@dataclass(frozen=True)
class MemoryProfile:
    """What the CUDA warm-up measured, all in bytes.

    Attributes:
        total: the device's memory.
        peak: most memory PyTorch allocated during the worst-case prefill, the
            temporary KV cache included.
        non_torch: memory in use outside PyTorch's allocator (CUDA context, NCCL).
        temp_cache: the temporary KV cache the prefill ran with.
        graphs: the decode CUDA graphs' memory pool (0 without graphs).
    """

    total: int
    peak: int
    non_torch: int
    temp_cache: int
    graphs: int

    def kv_budget(self, memory_fraction: float) -> int:
        """Bytes left for the KV cache within ``total × memory_fraction`` (>= 0)."""
        budget = (
            int(self.total * memory_fraction)
            - self.non_torch
            - (self.peak - self.temp_cache)
            - self.graphs
        )
        return max(budget, 0)

    def describe(self, memory_fraction: float) -> str:
        gib = 2**30
        return (
            f"memory: total {self.total / gib:.2f} GiB, warmup peak {self.peak / gib:.2f} GiB, "
            f"other {self.non_torch / gib:.2f} GiB, CUDA graphs {self.graphs / gib:.2f} GiB, "
            f"KV budget {self.kv_budget(memory_fraction) / gib:.2f} GiB"
        )


def check_kv_fits(
    num_blocks: int,
    chunks: list[SeqChunk],
    block_size: int,
    per_block: int,
    max_batch_prefill_tokens: int,
    max_total_tokens: int,
    memory_flag: str,
    hold_total: bool = True,
) -> None:
    """Raise unless ``num_blocks`` hold the worst-case prefill and, with ``hold_total``,
    one request of ``max_total_tokens``.

    Raises:
        KVCacheTooSmallError: naming ``memory_flag`` and the budget flags to change.
    """
    total_blocks = -(-max_total_tokens // block_size) if hold_total else 0
    need = max(blocks_needed(chunks), total_blocks)
    if num_blocks < need:
        budgets = f"max_batch_prefill_tokens={max_batch_prefill_tokens}"
        flags = "--max-batch-prefill-tokens"
        if hold_total:
            budgets += f" and max_total_tokens={max_total_tokens}"
            flags += " / --max-total-tokens"
        raise KVCacheTooSmallError(
            f"KV cache fits {num_blocks} blocks ({num_blocks * block_size} tokens, "
            f"{per_block} bytes per block) but warmup needs {need} blocks for "
            f"{budgets}: raise {memory_flag} or lower {flags}"
        )
