"""The vocabulary-parallel layers: the token embedding and the LM head.

Both split the vocabulary across tensor-parallel ranks (rows, see
:func:`~shard.layers.tp_layout.vocab_per_rank`): the embedding all-reduces the rows each
rank embeds, the LM head all-gathers the logits so every rank samples the same tokens.
Each takes this rank's :class:`~shard.distributed.ParallelContext` when it is
constructed, as the linear layers do (:mod:`shard.layers.linear`). Both stay in the
model's dtype when the linear layers hold fp8 weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import current_parallel
from shard.kernels.choices import current_kernels
from shard.layers.linear import linear_product
from shard.layers.tp_layout import vocab_per_rank
from shard.layers.weight_loader import (
    copy_piece,
    read_range,
    set_checkpoint_shapes,
    set_weight_loader,
)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across ranks: rank r holds rows
    ``[r * n, (r+1) * n)`` with ``n = ceil(vocab_size / tp_size)`` (rows past the
    vocabulary are zeros). Each rank embeds the ids it holds, zeros elsewhere, and
    the all-reduce assembles the full embedding.

    Forward: ``input_ids [num_tokens] int64 → [num_tokens, hidden_size]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_parallel()
        self.kernels = current_kernels()  # the LM head's product (ParallelLMHead)
        self.vocab_size = vocab_size
        self.num_local = vocab_per_rank(vocab_size, self.tp.size)
        self.packed_weight: torch.Tensor | None = None  # used by ParallelLMHead only
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        set_checkpoint_shapes(self.weight, [(None, (vocab_size, hidden_size))])

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        piece = read_range(loaded, 0, self.tp.rank * self.num_local, self.num_local)
        copy_piece(param.data[: piece.shape[0]], piece, "vocab slice")
        param.data[piece.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.tp.rank * self.num_local
        mask = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        out = out * mask[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, rows split across ranks; the logits are
    all-gathered so every rank holds (and samples from) the full row.

    Forward: ``hidden [n, hidden_size] → logits [n, vocab_size]`` in ``dtype``
    (float32 by default; None: the weights' dtype, the product's own output, which a
    float32 cast after it would hold exactly).
    """

    def forward(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        logits = linear_product(hidden, self.weight, self.packed_weight, None, self.kernels)
        if dtype is not None:
            logits = logits.to(dtype)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
