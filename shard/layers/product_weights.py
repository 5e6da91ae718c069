"""Passes over a built model's products: the weights of its tensor-parallel linear
layers (:mod:`shard.layers.linear`) and of its LM head
(:mod:`shard.layers.vocab_parallel`).

At load, :func:`pack_cpu_weights` packs the float32 CPU weights for oneDNN
(:func:`~shard.model_loader.build_model`); at warm-up, :func:`linear_weights` and
:func:`lm_head_weights` list the weights whose products the cuBLASLt tuning times
(:mod:`shard.kernels.gemm_tuning`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from shard.layers.linear import ParallelLinearBase, RowParallelLinear
from shard.layers.vocab_parallel import ParallelLMHead


class _ModuleTree(Protocol):
    def modules(self) -> Iterator[nn.Module]: ...


def pack_cpu_weights(model: _ModuleTree) -> int:
    """Reorder the float32 CPU weights of every linear layer and of the LM head into
    oneDNN's blocked layout, once, so each forward skips re-packing them.

    On CPU the plain ``F.linear`` (MKL sgemm) re-packs the weight on every call; with
    the few rows of a decode step that costs as much as the arithmetic. Measured on a
    2-core AVX-512 EPYC, one thread, SmolLM2-135M shapes, all weights of one step read
    from memory: 8 rows 84-104 ms per step with ``F.linear`` against 44 ms packed, 64
    rows 259 against 176 ms, and prefill rows about 15% faster (see
    benchmarks/results/serving-cpu.md). Results differ from ``F.linear`` by float32
    rounding only (another summation order).

    The dense weight of a packed layer is released (replaced by an empty tensor) unless
    another module shares it (a tied LM head keeps the embedding's). Layers on other
    devices or in other dtypes are left alone, as is everything when oneDNN is absent.

    Source: oneDNN inner-product primitive with a blocked weight format, reached through
    the ``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise`` operators that
    PyTorch's Inductor uses for the same purpose.

    Returns:
        Number of weight matrices packed.
    """
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return 0
    modules = [m for m in model.modules() if isinstance(m, (ParallelLinearBase, ParallelLMHead))]
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    packed: dict[int, torch.Tensor] = {}  # one packed copy per parameter
    for m in modules:
        weight = m.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        if id(weight) not in packed:
            packed[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        m.packed_weight = packed[id(weight)]
    for m in modules:
        if m.packed_weight is not None and owners.get(id(m.weight), 0) == 1:
            m.weight.data = m.weight.data.new_empty(0)
    return len(packed)


def linear_weights(model: _ModuleTree) -> list[torch.Tensor]:
    """The weights of every tensor-parallel linear layer of ``model`` whose product runs
    without a bias (the decoder layers' projections, a row-parallel layer's bias being
    added after the all-reduce; not the embedding or the LM head), in module order.
    fp8 weights are left out: their products run through ``torch._scaled_mm`` or our
    skinny kernel, which :func:`fp8_linear_weights` lists for the warm-up to choose
    between."""
    return [
        m.weight.detach()
        for m in model.modules()
        if isinstance(m, ParallelLinearBase)
        and (m.bias is None or isinstance(m, RowParallelLinear))
        and m.weight_scale is None
    ]


def fp8_linear_weights(model: _ModuleTree) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight [out, in] float8_e4m3fn, weight_scale [out] float32) of every linear layer of
    ``model`` with fp8 weights, in module order: the products the warm-up's fp8 tuning
    times (:mod:`shard.kernels.fp8_tuning`)."""
    return [
        (m.weight.detach(), m.weight_scale.detach())
        for m in model.modules()
        if isinstance(m, ParallelLinearBase) and m.weight_scale is not None
    ]


def lm_head_weights(model: _ModuleTree) -> list[torch.Tensor]:
    """The weights of ``model``'s LM heads (:class:`ParallelLMHead`; one in a causal LM)."""
    return [m.weight.detach() for m in model.modules() if isinstance(m, ParallelLMHead)]
