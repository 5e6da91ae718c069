"""oneDNN weight packing of float32 CPU linear layers
(shard.layers.product_weights.pack_cpu_weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.layers.product_weights import pack_cpu_weights
from shard.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build"
)


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.device("cpu"):
            self.embed = VocabParallelEmbedding(50, 16).to(dtype)
            self.up = ColumnParallelLinear(16, 24, bias=True).to(dtype)
            self.down = RowParallelLinear(24, 16, bias=True).to(dtype)
            self.head = ParallelLMHead(50, 16).to(dtype)
        self.head.weight = self.embed.weight  # tied, as in SmolLM2
        for p in self.parameters():
            p.data.normal_(0, 0.2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(self.embed(ids))))


def test_packed_forward_matches_and_dense_copies_are_released() -> None:
    model = Tiny()
    ids = torch.tensor([1, 7, 49, 3, 0])
    expected = model(ids)
    assert pack_cpu_weights(model) == 3
    assert model.up.packed_weight is not None and model.head.packed_weight is not None
    assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (50, 16)
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids[:1]), expected[:1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids.repeat(40)), expected.repeat(40, 1), atol=1e-5, rtol=1e-5)


def test_other_dtypes_are_left_alone() -> None:
    model = Tiny(torch.bfloat16)
    assert pack_cpu_weights(model) == 0
    assert model.up.packed_weight is None and model.up.weight.numel() == 24 * 16
