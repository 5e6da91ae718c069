"""Tensor-parallel linear layers whose parameters load themselves.

Layout from Megatron-LM (Shoeybi et al. 2019, §3): in each block a column-parallel
layer (q/k/v, gate/up: output features split) feeds a row-parallel one (o_proj,
down_proj: input features split) whose partial sums are all-reduced, so one block costs
one all-reduce and the model code never sees a rank. Each layer takes this rank's
:class:`~shard.distributed.ParallelContext` from
:func:`~shard.distributed.current_parallel` when it is constructed (the model is built
inside :func:`~shard.distributed.parallel_context`).

Every parameter carries its ``weight_loader`` and ``checkpoint_shapes``
(:mod:`shard.layers.weight_loader`), so each rank reads only its own rows/columns.

Built inside :func:`~shard.quantization.config.quantization_context` with fp8 weights,
the q/k/v, o, gate/up and down layers hold their weight in float8 e4m3 with a
``weight_scale`` per output channel (:mod:`shard.layers.fp8`); else their product runs
through :func:`linear_product`.

Elsewhere: the embedding and the LM head, which split the vocabulary and stay in the
model's dtype (:mod:`shard.layers.vocab_parallel`); packing float32 CPU weights for
oneDNN and the weight lists warm-up tunes (:mod:`shard.layers.product_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import ParallelContext, current_parallel
from shard.kernels.choices import KernelChoices, current_kernels
from shard.layers import fp8
from shard.layers.tp_layout import first_kv_head, kv_heads_per_rank
from shard.layers.weight_loader import (
    copy_piece,
    default_weight_loader,
    read_range,
    set_checkpoint_shapes,
    set_weight_loader,
)


def linear_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    kernels: KernelChoices,
) -> torch.Tensor:
    """The unquantized product ``x @ weight.T + bias``: through the oneDNN-packed copy
    of ``weight`` when there is one (see
    :func:`~shard.layers.product_weights.pack_cpu_weights`); on CUDA at up to 16 rows
    (decode at small batch, short prefills) through our skinny GEMM kernel
    (:mod:`shard.kernels.skinny_gemm`), else through the cuBLASLt algorithm tuned at
    warm-up for the shape and row count, if any (:mod:`shard.kernels.gemm_tuning`), as
    ``kernels`` has them; else ``F.linear``."""
    if packed is not None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    if x.is_cuda:
        kernel = kernels.skinny_linear
        skinny = kernel(x, weight, bias, pdl=kernels.pdl) if kernel is not None else None
        if skinny is not None:  # None: rows or dtypes the kernel does not take
            return skinny
        if kernels.gemms.tuned():
            tuned = kernels.gemms.run(x, weight, bias)
            if tuned is not None:
                return tuned
    return F.linear(x, weight, bias)


def _check_divisible(value: int, tp: ParallelContext, what: str) -> None:
    if value % tp.size != 0:
        raise ValueError(f"{what}={value} is not divisible by tp_size={tp.size}")


class ParallelLinearBase(nn.Module):
    """The fields common to the linear layers: ``weight [out_local, in_local]``, optional
    ``bias [out_local]``, and ``packed_weight`` (set by
    :func:`~shard.layers.product_weights.pack_cpu_weights`), ``tp``, the parallel context
    the layer was built in, and ``kernels``, the kernel choices of the model it was
    built for (:func:`~shard.kernels.choices.current_kernels`). With fp8 weights (see
    the module doc) ``weight`` is float8_e4m3fn and ``weight_scale [out_local]`` float32
    holds its scales, ``input_scale`` (scalar) a checkpoint's static activation scale
    or None."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = current_kernels()
        self.packed_weight: torch.Tensor | None = None
        self.weight_scale, self.input_scale = fp8.scale_params(out_local, self.weight_loader)
        dtype = fp8.FP8_DTYPE if self.weight_scale is not None else None
        self.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=dtype), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    @property
    def takes_fp8_activations(self) -> bool:
        """Whether the product takes its input already quantized per token
        (:class:`~shard.quantization.fp8.Fp8Activations`): fp8 weights whose activations
        are quantized per token at run time (no checkpoint ``input_scale``)."""
        return self.weight_scale is not None and self.input_scale is None

    def _product(
        self, x: torch.Tensor | fp8.Fp8Activations, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight.T + bias``: the fp8 product for fp8 weights, else
        :func:`linear_product`."""
        if self.weight_scale is not None:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale,
                                  few_rows=self.kernels.fp8_product)
        assert isinstance(x, torch.Tensor), "quantized activations for unquantized weights"
        return linear_product(x, self.weight, self.packed_weight, bias, self.kernels)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        """Where the output rows of checkpoint tensor ``shard_id`` go: (first row here,
        rows, first row in the checkpoint tensor)."""
        raise NotImplementedError

    def _store_rows(
        self, param: nn.Parameter, shard_id: Any, piece: torch.Tensor, what: str
    ) -> None:
        """Copy ``piece`` (this rank's rows of checkpoint tensor ``shard_id``) into
        ``param``; an fp8 layer's weight quantized per row unless already fp8, its
        scales loaded (:func:`shard.layers.fp8.store_rows`)."""
        offset, size, _ = self._rows(shard_id)
        if self.weight_scale is not None and param is not self.bias:
            fp8.store_rows(self, param, offset, size, piece, what)
            return
        copy_piece(param.data.narrow(0, offset, size), piece, what)

    def _record_shapes(self, shapes: Sequence[tuple[Any, int]], input_size: int) -> None:
        """Checkpoint shapes from ``(shard_id, full output size)`` pairs."""
        set_checkpoint_shapes(self.weight, [(s, (out, input_size)) for s, out in shapes])
        if self.bias is not None:
            set_checkpoint_shapes(self.bias, [(s, (out,)) for s, out in shapes])

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinearBase):
    """``y = x W^T + b`` with W's rows (output features) split across ranks; no
    communication.

    Args:
        input_size: input features (full).
        output_size: output features (full); this rank holds output_size / tp_size.

    Forward: ``[num_tokens, input_size] → [num_tokens, output_size / tp_size]``; the
    input may come quantized (:attr:`takes_fp8_activations`).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_parallel()
        _check_divisible(output_size, tp, "output_size")
        super().__init__(input_size, output_size // tp.size, bias, tp)
        self._record_shapes([(None, output_size)], input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        rows = self.weight.shape[0]
        return 0, rows, self.tp.rank * rows

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        shard_id = args[0] if args else None
        if fp8.is_scale(self, param):
            fp8.load_scale(self, param, loaded, shard_id)
            return
        _, size, start = self._rows(shard_id)
        self._store_rows(
            param,
            shard_id,
            read_range(loaded, 0, start, size),
            f"shard {shard_id}" if args else "column slice",
        )

    def forward(self, x: torch.Tensor | fp8.Fp8Activations) -> torch.Tensor:
        return self._product(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (e.g. gate_proj + up_proj). Checkpoint tensors load by ``shard_id`` (index into
    ``output_sizes``); each is split across ranks independently, so a rank holds
    ``[gate_local | up_local]``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False):
        for size in output_sizes:
            _check_divisible(size, current_parallel(), "output_size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        self._record_shapes(list(enumerate(output_sizes)), input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        sizes = [s // self.tp.size for s in self.output_sizes]
        index = int(shard_id)
        return sum(sizes[:index]), sizes[index], self.tp.rank * sizes[index]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split across ranks, KV heads split or, when
    fewer than ranks, replicated (see :mod:`shard.layers.tp_layout`).

    Output layout per rank: ``[q (num_heads_local * head_dim) | k | v]`` with
    ``num_kv_heads_local * head_dim`` each for k and v. Checkpoint tensors load with
    ``shard_id`` in ``{"q", "k", "v"}``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ):
        tp = current_parallel()
        _check_divisible(num_heads, tp, "num_heads")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} cannot be split over {tp.size} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.first_kv_head = first_kv_head(num_kv_heads, tp.rank, tp.size)
        # The local width is what this rank holds (KV heads may be replicated).
        total_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, total_local * tp.size, bias)
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        self._record_shapes([("q", q_full), ("k", kv_full), ("v", kv_full)], hidden_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size, self.tp.rank * q_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        return offset, kv_size, self.first_kv_head * self.head_dim


class RowParallelLinear(ParallelLinearBase):
    """``y = x W^T + b`` with W's columns (input features) split across ranks; partial
    outputs are summed with an all-reduce. The bias is added once, after the reduce.

    Forward: ``[num_tokens, input_size / tp_size] → [num_tokens, output_size]``; the
    input may come quantized (:attr:`takes_fp8_activations`).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_parallel()
        _check_divisible(input_size, tp, "input_size")
        super().__init__(input_size // tp.size, output_size, bias, tp)
        self._record_shapes([(None, output_size)], input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, self.weight.shape[0], 0  # every output row, scales included

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        if fp8.is_scale(self, param):
            fp8.load_scale(self, param, loaded, None)
            return
        if param.dim() == 1:
            default_weight_loader(param, loaded)
            return
        cols = param.shape[1]
        self._store_rows(param, None, read_range(loaded, 1, self.tp.rank * cols, cols), "row slice")

    def forward(self, x: torch.Tensor | fp8.Fp8Activations) -> torch.Tensor:
        y = self.tp.all_reduce(self._product(x, None))
        return y if self.bias is None else y + self.bias
