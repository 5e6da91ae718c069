"""Greedy sampling in one pass over the logits (CUDA; the interpreter in tests): each
row's argmax and its log-probability ``max − logsumexp(row)``.

The torch path (:func:`shard.sampling.sample_greedy` off CUDA, the reference) reads the
logits three times in four kernels (argmax, max, exp and sum for the logsumexp). Here
one program per row streams the row once in tiles, keeping the running maximum, its
index and the sum of ``exp(x − max)`` rescaled whenever the maximum grows: the online
softmax normaliser of Milakov & Gimelshein, "Online normalizer calculation for softmax"
(2018). The logprob of the argmax is then ``−log(sum)``. Ties go to the lowest index, as
``torch.argmax``'s do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.pdl import launch_options, pdl_start

BLOCK = 4096  # logits per tile (a 49152-token vocabulary is 12 tiles)


@triton.jit
def _greedy_kernel(logits_ptr, ids_ptr, logprobs_ptr, stride_row, vocab,
                   BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)  # sum of exp(x - best) over the tiles so far
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab,
                    other=float("-inf")).to(tl.float32)
        tile_max, tile_arg = tl.max(x, 0, return_indices=True,
                                    return_indices_tie_break_left=True)
        new_best = tl.maximum(best, tile_max)
        # rescale around a finite value: while every logit so far is -inf, exp(-inf -
        # -inf) would be NaN (an all -inf row ends with logprob +inf)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), 0)
        best_id = tl.where(tile_max > best, start + tile_arg, best_id)
        best = new_best
    tl.store(ids_ptr + row, best_id.to(tl.int64))
    tl.store(logprobs_ptr + row, -tl.log(total))


def greedy(logits: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax and its log-probability per row.

    Args:
        logits: [batch, vocab], float32/bfloat16/float16, last dim contiguous; -inf
            allowed (masked tokens), NaN not.
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Returns:
        (token ids [batch] int64, logprobs [batch] float32).
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [batch, vocab], rows contiguous"
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        _greedy_kernel[(batch,)](logits, ids, logprobs, logits.stride(0), vocab, BLOCK=BLOCK,
                                 num_warps=8, **launch_options(logits.device, pdl))
    return ids, logprobs
