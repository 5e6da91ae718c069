"""KV cache sizing and the worst-case warmup prefill.

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

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shard.errors import KVCacheTooSmallError
from shard.inputs import SeqChunk
from shard.kv_cache import allocate_kv_cache, bytes_per_block
from shard.progress import PhaseProgress
from shard.sampling import SamplingParams, SamplingRow, sample

if TYPE_CHECKING:
    from shard.model_runner import ModelRunner

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


def _run_dummy_prefill(runner: ModelRunner, chunks: list[SeqChunk]) -> None:
    inputs, hidden = runner.run_chunks(chunks, is_prefill=True)
    logits = runner.model.compute_logits(hidden[inputs.last_token_indices])
    rows = [
        SamplingRow(SamplingParams(do_sample=True, top_p=0.9, top_k=50), top_n=5) for _ in chunks
    ]
    sample(logits, rows)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _cuda_num_blocks(
    runner: ModelRunner,
    chunks: list[SeqChunk],
    per_block: int,
    graph_buckets: Sequence[int],
    max_total_tokens: int,
) -> int:
    device = runner.device
    temp_blocks = blocks_needed(chunks)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.bind_kv_cache(
        allocate_kv_cache(
            runner.model_config, temp_blocks, runner.block_size, runner.dtype, device,
            runner.config.world_size,
        )
    )
    _run_dummy_prefill(runner, chunks)
    peak = torch.cuda.max_memory_allocated(device)
    graph_bytes = 0
    if graph_buckets:
        before = torch.cuda.memory_reserved(device)
        runner.capture_graphs(graph_buckets, max_total_tokens)
        graph_bytes = max(0, torch.cuda.memory_reserved(device) - before)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    runner.unbind_kv_cache()
    torch.cuda.empty_cache()
    budget = (
        int(total * runner.config.gpu_memory_fraction)
        - non_torch
        - (peak - temp_blocks * per_block)
        - graph_bytes
    )
    runner.log.info(
        "memory: total {:.2f} GiB, warmup peak {:.2f} GiB, other {:.2f} GiB, "
        "CUDA graphs {:.2f} GiB, KV budget {:.2f} GiB",
        total / 2**30,
        peak / 2**30,
        non_torch / 2**30,
        graph_bytes / 2**30,
        max(budget, 0) / 2**30,
    )
    return max(budget, 0) // per_block


def run_warmup(
    runner: ModelRunner,
    max_batch_prefill_tokens: int,
    max_total_tokens: int,
    graph_buckets: Sequence[int] = (),
) -> int:
    """Allocate the KV cache, run the worst-case prefill through it and capture the
    decode CUDA graphs.

    Args:
        max_batch_prefill_tokens: prefill token budget, in tokens (> 0).
        max_total_tokens: longest request (prompt + generated), in tokens (> 0).
        graph_buckets: decode batch sizes to capture (CUDA only; empty = none).

    Returns:
        the number of KV blocks allocated.

    Raises:
        ValueError: a budget is 0.
        KVCacheTooSmallError: the cache cannot hold the worst-case prefill or one
            request of max_total_tokens; the message names the flag to change.
    """
    if max_batch_prefill_tokens <= 0 or max_total_tokens <= 0:
        raise ValueError("max_batch_prefill_tokens and max_total_tokens must be > 0")
    per_block = bytes_per_block(
        runner.model_config, runner.block_size, runner.dtype, runner.config.world_size
    )
    chunks = dummy_chunks(max_batch_prefill_tokens, max_total_tokens, runner.block_size)
    with PhaseProgress("warm-up", WARMUP_PHASES + bool(graph_buckets), runner.log,
                       show_bar=runner.config.rank == 0) as progress:
        return _warmup(runner, chunks, per_block, max_batch_prefill_tokens, max_total_tokens,
                       graph_buckets, progress)


def _warmup(runner: ModelRunner, chunks: list[SeqChunk], per_block: int,
            max_batch_prefill_tokens: int, max_total_tokens: int,
            graph_buckets: Sequence[int], progress: PhaseProgress) -> int:
    """:func:`run_warmup` once the worst-case prefill is known, phase by phase."""
    if runner.device.type == "cuda":
        progress.phase(
            f"profiling a worst-case prefill of {max_batch_prefill_tokens} tokens"
            + (" and the decode CUDA graphs" if graph_buckets else "")
        )
        num_blocks = _cuda_num_blocks(
            runner, chunks, per_block, graph_buckets, max_total_tokens
        )
        memory_flag = "--gpu-memory-fraction"
    else:
        progress.phase("sizing the KV cache (--kv-cache-bytes)")
        num_blocks = runner.config.kv_cache_bytes // per_block
        memory_flag = "--kv-cache-bytes"
    need = max(blocks_needed(chunks), -(-max_total_tokens // runner.block_size))
    if num_blocks < need:
        raise KVCacheTooSmallError(
            f"KV cache fits {num_blocks} blocks ({num_blocks * runner.block_size} tokens, "
            f"{per_block} bytes per block) but warmup needs {need} blocks for "
            f"max_batch_prefill_tokens={max_batch_prefill_tokens} and "
            f"max_total_tokens={max_total_tokens}: raise {memory_flag} or lower "
            "--max-batch-prefill-tokens / --max-total-tokens"
        )
    progress.phase(f"allocating the KV cache: {num_blocks} blocks of {runner.block_size} tokens")
    runner.bind_kv_cache(
        allocate_kv_cache(
            runner.model_config, num_blocks, runner.block_size, runner.dtype, runner.device,
            runner.config.world_size,
        )
    )
    progress.phase("running the worst-case prefill through the cache")
    _run_dummy_prefill(runner, chunks)
    if graph_buckets:
        progress.phase(f"capturing decode CUDA graphs for batch sizes up to {graph_buckets[-1]}")
        started = time.perf_counter()
        runner.capture_graphs(graph_buckets, max_total_tokens)
        runner.log.info(
            "captured decode CUDA graphs for batch sizes {} in {:.1f} s",
            list(graph_buckets), time.perf_counter() - started,
        )
    return num_blocks
