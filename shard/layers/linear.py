"""Tensor-parallel-shaped linear layers whose parameters load themselves.

Every parameter carries ``weight_loader(param, loaded_tensor[, shard_id])`` so loading
a checkpoint is a short loop (see :mod:`shard.weights`). Layers hold ``tp_rank`` /
``tp_size`` and slice the checkpoint tensor for their rank in the loader:

- column parallel: output features split across ranks (weight rows),
- row parallel: input features split across ranks (weight columns), outputs summed
  with an all-reduce,
- vocab parallel: embedding rows split across ranks.

NOTE: only ``tp_size == 1`` is exercised today. The slicing below is written for any
``tp_size``; the collectives (:func:`_all_reduce`, :func:`_all_gather`) raise until
tensor parallelism is wired up, so model code never has to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach ``loader`` to ``param`` as ``param.weight_loader``."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's ``weight_loader``, or :func:`default_weight_loader`."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into ``param``.

    Raises:
        ValueError: on a shape mismatch.
    """
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def _narrow(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous 1/tp_size slice of ``loaded`` along ``dim``."""
    if tp_size == 1:
        return loaded
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor parallelism (tp_size > 1) is not wired up yet")


def _all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor parallelism (tp_size > 1) is not wired up yet")


def _check_divisible(value: int, tp_size: int, what: str) -> None:
    if value % tp_size != 0:
        raise ValueError(f"{what}={value} is not divisible by tp_size={tp_size}")


class _ParallelLinearBase(nn.Module):
    """Common fields: ``weight [out_local, in_local]``, optional ``bias [out_local]``."""

    def __init__(
        self, in_local: int, out_local: int, bias: bool, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with W's rows (output features) split across ranks.

    Args:
        input_size: input features (full).
        output_size: output features (full); this rank holds output_size / tp_size.

    Forward: ``[num_tokens, input_size] → [num_tokens, output_size / tp_size]``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        _check_divisible(output_size, tp_size, "output_size")
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        default_weight_loader(param, _narrow(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (e.g. gate_proj + up_proj). Checkpoint tensors load by ``shard_id`` (index into
    ``output_sizes``); each is split across ranks independently.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        for size in output_sizes:
            _check_divisible(size, tp_size, "output_size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        (shard_id,) = args
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[: int(shard_id)])
        target = param.data.narrow(0, offset, sizes[int(shard_id)])
        piece = _narrow(loaded, 0, self.tp_rank, self.tp_size)
        if target.shape != piece.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id}: "
                f"{tuple(target.shape)} vs {tuple(piece.shape)}"
            )
        target.copy_(piece)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads are split across ranks.

    Output layout per rank: ``[q (num_heads_local * head_dim) | k | v]``.
    Checkpoint tensors load with ``shard_id`` in ``{"q", "k", "v"}``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        _check_divisible(num_heads, tp_size, "num_heads")
        _check_divisible(num_kv_heads, tp_size, "num_kv_heads")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        (shard_id,) = args
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        target = param.data.narrow(0, offset, size)
        piece = _narrow(loaded, 0, self.tp_rank, self.tp_size)
        if target.shape != piece.shape:
            raise ValueError(
                f"shape mismatch for {shard_id}: {tuple(target.shape)} vs {tuple(piece.shape)}"
            )
        target.copy_(piece)


class RowParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with W's columns (input features) split across ranks; partial
    outputs are summed with an all-reduce. The bias is added once, after the reduce.

    Forward: ``[num_tokens, input_size / tp_size] → [num_tokens, output_size]``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        _check_divisible(input_size, tp_size, "input_size")
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        piece = loaded if param.dim() == 1 else _narrow(loaded, 1, self.tp_rank, self.tp_size)
        default_weight_loader(param, piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _all_reduce(F.linear(x, self.weight), self.tp_size)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across ranks.

    Forward: ``input_ids [num_tokens] int64 → [num_tokens, hidden_size]``.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        _check_divisible(vocab_size, tp_size, "vocab_size")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.vocab_size = vocab_size
        self.num_local = vocab_size // tp_size
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: Any) -> None:
        default_weight_loader(param, _narrow(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start = self.tp_rank * self.num_local
        local = input_ids - start
        mask = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight) * mask[:, None].to(
            self.weight.dtype
        )
        return _all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, rows split across ranks; logits gathered.

    Forward: ``hidden [n, hidden_size] → logits [n, vocab_size]`` in float32.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).to(torch.float32)
        return _all_gather(logits, self.tp_size)
