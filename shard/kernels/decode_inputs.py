"""A captured decode graph's static inputs filled in one kernel (CUDA; the interpreter in
tests).

Before each replay, :meth:`shard.cuda_graphs.DecodeGraphs.run` moves the batch's decode
state (:class:`shard.decode_state.DecodeRows`) into the graph's static buffers: input
ids, positions, context lengths, block tables, and the slot each new token's K/V go to,
with the bucket's padding rows reset (no cache write, a one-token context). As torch ops
that is about a dozen small kernels per step, each a few microseconds of launch and
ramp on the device; here one program per row of the bucket does all of it.

:func:`fill_decode_inputs_torch` is the reference (and the path where Triton cannot run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.decode_state import decode_slot_mapping
from shard.kernels.pdl import launch_options, pdl_start

BLOCK_W = 128  # block-table columns per tile


# NOTE: the batch size and the source table's width change from step to step; specialised
# (Triton specialises integers equal to 1 or divisible by 16) they would each compile a
# variant while serving.
@triton.jit(do_not_specialize=["tables_stride", "n", "width"])
def _decode_inputs_kernel(tokens_ptr, seq_lens_ptr, tables_ptr, tables_stride,
                          input_ids_ptr, positions_ptr, out_seq_lens_ptr, slot_mapping_ptr,
                          out_tables_ptr, out_tables_stride, n, width, block_size,
                          BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0)
    if row < n:
        pos = tl.load(seq_lens_ptr + row)  # int32: tokens cached = the input's position
        tl.store(input_ids_ptr + row, tl.load(tokens_ptr + row))
        tl.store(positions_ptr + row, pos.to(tl.int64))
        tl.store(out_seq_lens_ptr + row, pos + 1)
        src = tables_ptr + row.to(tl.int64) * tables_stride
        block = tl.load(src + pos // block_size)
        tl.store(slot_mapping_ptr + row,
                 block.to(tl.int64) * block_size + (pos % block_size).to(tl.int64))
        dst = out_tables_ptr + row.to(tl.int64) * out_tables_stride
        cols = tl.arange(0, BLOCK_W)
        for start in range(0, width, BLOCK_W):
            mask = start + cols < width
            tl.store(dst + start + cols, tl.load(src + start + cols, mask=mask), mask=mask)
    else:  # a padding row: no cache write, a one-token context in its table's block
        tl.store(input_ids_ptr + row, tl.zeros([], tl.int64))
        tl.store(positions_ptr + row, tl.zeros([], tl.int64))
        tl.store(out_seq_lens_ptr + row, tl.full([], 1, tl.int32))
        tl.store(slot_mapping_ptr + row, tl.full([], -1, tl.int64))


def _check(tokens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
           input_ids: torch.Tensor, positions: torch.Tensor, out_seq_lens: torch.Tensor,
           slot_mapping: torch.Tensor, out_tables: torch.Tensor) -> None:
    n = tokens.shape[0]
    assert seq_lens.shape == (n,) and block_tables.shape[0] == n, "one row per request"
    assert tokens.dtype == torch.int64 and seq_lens.dtype == torch.int32
    assert block_tables.dtype == out_tables.dtype == torch.int32
    assert input_ids.dtype == positions.dtype == slot_mapping.dtype == torch.int64
    assert out_seq_lens.dtype == torch.int32
    rows = input_ids.shape[0]
    assert n <= rows and out_tables.shape[0] >= rows, "more requests than the bucket's rows"
    assert positions.shape == out_seq_lens.shape == slot_mapping.shape == (rows,)
    assert block_tables.stride(1) == 1 and out_tables.stride(1) == 1


def fill_decode_inputs(tokens: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, block_size: int,
                       input_ids: torch.Tensor, positions: torch.Tensor,
                       out_seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                       out_tables: torch.Tensor, *, pdl: bool = False) -> None:
    """Fill a decode step's static inputs for ``bucket`` rows from ``n`` requests' state.

    Args:
        tokens: [n] int64, each request's input token (its last sampled one).
        seq_lens: [n] int32, tokens of each request in the KV cache (= the input's
            position).
        block_tables: [n, width] int32, each request's blocks (columns contiguous).
        block_size: tokens per KV block.
        input_ids, positions: [bucket] int64 outputs: the tokens and their positions.
        out_seq_lens: [bucket] int32 output: context lengths after this step
            (``seq_lens + 1``).
        slot_mapping: [bucket] int64 output: the cache slot of each input token
            (``block_table[p // block_size] * block_size + p % block_size``).
        out_tables: [≥ bucket, out_width] int32 output: rows ``[:n]`` get the first
            ``min(width, out_width)`` columns of ``block_tables`` (columns beyond are
            never read at the captured context length).
        pdl: launch with programmatic dependent launch where it runs
            (:func:`shard.kernels.pdl.launch_options`).

    Rows ``n`` to ``bucket`` are padding: input id and position 0, context length 1,
    slot -1 (the KV write skips it); their table rows keep what they hold (any block
    id there is a valid block, read for one masked-out position).
    """
    _check(tokens, seq_lens, block_tables, input_ids, positions, out_seq_lens,
           slot_mapping, out_tables)
    n, bucket = tokens.shape[0], input_ids.shape[0]
    width = min(block_tables.shape[1], out_tables.shape[1])
    if bucket:
        _decode_inputs_kernel[(bucket,)](
            tokens, seq_lens, block_tables, block_tables.stride(0), input_ids, positions,
            out_seq_lens, slot_mapping, out_tables, out_tables.stride(0), n, width,
            block_size, BLOCK_W=BLOCK_W, num_warps=1, **launch_options(tokens.device, pdl))


def fill_decode_inputs_torch(tokens: torch.Tensor, seq_lens: torch.Tensor,
                             block_tables: torch.Tensor, block_size: int,
                             input_ids: torch.Tensor, positions: torch.Tensor,
                             out_seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                             out_tables: torch.Tensor, *, pdl: bool = False) -> None:
    """:func:`fill_decode_inputs` as torch ops (the reference; same arguments, ``pdl``
    ignored)."""
    _check(tokens, seq_lens, block_tables, input_ids, positions, out_seq_lens,
           slot_mapping, out_tables)
    n = tokens.shape[0]
    width = min(block_tables.shape[1], out_tables.shape[1])
    input_ids[:n].copy_(tokens)
    positions[:n].copy_(seq_lens)
    torch.add(seq_lens, 1, out=out_seq_lens[:n])
    out_tables[:n, :width].copy_(block_tables[:, :width])
    slot_mapping[:n].copy_(decode_slot_mapping(block_tables, positions[:n], block_size))
    input_ids[n:].zero_()
    positions[n:].zero_()
    out_seq_lens[n:].fill_(1)
    slot_mapping[n:].fill_(-1)
