"""Tensor-parallel layout: valid shard counts, KV head replication, slice reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shard.distributed import ParallelContext, current_parallel, parallel_context
from shard.layers.linear import QKVParallelLinear, RowParallelLinear
from shard.layers.tp_layout import check_tp_size, first_kv_head, valid_tp_sizes
from shard.layers.vocab_parallel import VocabParallelEmbedding


def test_nine_heads_over_two_names_valid_counts() -> None:
    with pytest.raises(ValueError, match=r"valid --num-shard values: 1, 3$"):
        check_tp_size(9, 3, 1536, 2)
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]  # 1536 is not divisible by 9
    assert valid_tp_sizes(9, 3, 1539) == [1, 3, 9]
    check_tp_size(9, 3, 1536, 3)


def test_kv_heads_replicate_over_more_ranks() -> None:
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 use KV head 0, ranks 2-3 head 1
    assert [first_kv_head(2, r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [first_kv_head(4, r, 2) for r in range(2)] == [0, 2]
    assert valid_tp_sizes(8, 2, 64) == [1, 2, 4, 8]
    assert 3 not in valid_tp_sizes(12, 4, 48)  # 4 KV heads neither split nor replicate


class RecordingSlice:
    """A lazy safetensors slice that records which ranges are read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[Any] = []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.reads.append(index)
        return self.tensor[index]


def test_loaders_read_only_their_slice() -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    with parallel_context(ParallelContext(rank=1, size=2)):
        qkv = QKVParallelLinear(6, 2, num_heads=4, num_kv_heads=1)
    q = RecordingSlice(full)
    qkv.weight.weight_loader(qkv.weight, q, "q")  # type: ignore[attr-defined]
    assert q.reads == [(slice(4, 8),)]
    k = RecordingSlice(full[:2])
    qkv.weight.weight_loader(qkv.weight, k, "k")  # type: ignore[attr-defined]
    assert k.reads == [(slice(0, 2),)]  # the one KV head, replicated on rank 1
    assert torch.equal(qkv.weight[:4], full[4:8])
    with parallel_context(ParallelContext(rank=1, size=3)):
        row = RowParallelLinear(6, 8)
    w = RecordingSlice(full)
    row.weight.weight_loader(row.weight, w)  # type: ignore[attr-defined]
    assert w.reads == [(slice(None), slice(2, 4))]
    assert torch.equal(row.weight, full[:, 2:4])


def test_vocab_rows_pad_on_the_last_rank() -> None:
    full = torch.randn(10, 4)
    with parallel_context(ParallelContext(rank=2, size=3)):
        last = VocabParallelEmbedding(10, 4)  # 4 rows per rank
    last.weight.weight_loader(last.weight, RecordingSlice(full))  # type: ignore[attr-defined]
    assert torch.equal(last.weight[:2], full[8:10])
    assert torch.equal(last.weight[2:], torch.zeros(2, 4))


def test_layers_take_the_parallel_context_they_are_built_in() -> None:
    """A layer keeps the context of its construction; leaving the block restores the
    single-rank default."""
    with parallel_context(ParallelContext(rank=1, size=2)) as tp:
        inner = RowParallelLinear(8, 4)
        assert current_parallel() is tp
    outer = RowParallelLinear(8, 4)
    assert inner.tp == ParallelContext(1, 2) and inner.weight.shape == (4, 4)
    assert outer.tp == ParallelContext() and outer.weight.shape == (4, 8)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ParallelContext(rank=2, size=2)
