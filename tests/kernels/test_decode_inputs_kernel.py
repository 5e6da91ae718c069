"""The one-kernel fill of a decode graph's static inputs against its torch reference
(the ops it replaces): every output buffer equal, padding rows reset, table columns
beyond the captured width and padding rows' tables untouched; on CUDA, and in Triton's
interpreter elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shard.kernels.decode_inputs import BLOCK_W, fill_decode_inputs, fill_decode_inputs_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _state(n: int, width: int, block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n,), generator=gen)
    # every position's block lies inside the table
    seq_lens = torch.randint(0, width * block_size, (n,), generator=gen).to(torch.int32)
    tables = torch.randint(0, 10_000, (n, width), generator=gen).to(torch.int32)
    return tokens.to(DEVICE), seq_lens.to(DEVICE), tables.to(DEVICE)


def _buffers(bucket: int, out_width: int, stale: int):
    """Static buffers as a previous step left them: every value ``stale``."""
    return (
        torch.full((bucket,), stale, dtype=torch.int64, device=DEVICE),
        torch.full((bucket,), stale, dtype=torch.int64, device=DEVICE),
        torch.full((bucket,), stale, dtype=torch.int32, device=DEVICE),
        torch.full((bucket,), stale, dtype=torch.int64, device=DEVICE),
        torch.full((bucket + 3, out_width), stale, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize(
    ("n", "bucket", "width", "out_width", "block_size"),
    [
        (1, 1, 1, 4, 16),  # batch 1, a one-block table
        (5, 8, 7, 9, 16),  # padding rows, a narrower source table
        (8, 8, 300, 2 * BLOCK_W + 5, 16),  # several column tiles
        (6, 16, 40, 10, 32),  # a source wider than the captured width
        (3, 4, 5, 5, 1),  # one-token blocks
        (0, 4, 1, 3, 16),  # nothing but padding (the capture's first fill)
    ],
)
def test_kernel_matches_torch(n: int, bucket: int, width: int, out_width: int,
                              block_size: int) -> None:
    tokens, seq_lens, tables = _state(n, width, block_size, seed=n * 100 + width)
    got, want = _buffers(bucket, out_width, 7), _buffers(bucket, out_width, 7)
    fill_decode_inputs(tokens, seq_lens, tables, block_size, *got[:4], got[4])
    fill_decode_inputs_torch(tokens, seq_lens, tables, block_size, *want[:4], want[4])
    names = ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), name
    input_ids, positions, out_seq_lens, slots, out_tables = got
    copied = min(width, out_width)
    assert torch.equal(out_tables[:n, :copied], tables[:, :copied])
    assert (out_tables[:n, copied:] == 7).all()  # beyond the captured width: untouched
    assert (out_tables[n:] == 7).all()  # padding rows' tables: untouched
    assert torch.equal(input_ids[:n], tokens) and (input_ids[n:] == 0).all()
    assert torch.equal(positions[:n], seq_lens.to(torch.int64)) and (positions[n:] == 0).all()
    assert torch.equal(out_seq_lens[:n], seq_lens + 1) and (out_seq_lens[n:] == 1).all()
    assert (slots[n:] == -1).all()
    for row in range(n):
        pos = int(seq_lens[row])
        assert int(slots[row]) == int(tables[row, pos // block_size]) * block_size + (
            pos % block_size)


def test_more_requests_than_the_bucket_are_refused() -> None:
    tokens, seq_lens, tables = _state(5, 2, 16, seed=3)
    with pytest.raises(AssertionError, match="more requests"):
        fill_decode_inputs(tokens, seq_lens, tables, 16, *_buffers(4, 2, 0))
