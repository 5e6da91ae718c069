"""Activations handed to the fp8 product already quantized per token
(:class:`~shard.quantization.fp8.Fp8Activations`): the product is the one that quantizes
its input itself, bit for bit; which layers take them; and without our kernels (CPU) the
norm and SwiGLU built for them keep writing plain rows. The kernels that write them:
tests/kernels/test_fp8_activations.py."""

from __future__ import annotations

import pytest
import torch

from shard.distributed import ParallelContext, parallel_context
from shard.layers.activation import SiluAndMul
from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.layers.norm import RMSNorm
from shard.quantization.config import Fp8Weights, quantization_context
from shard.quantization.fp8 import Fp8Activations, fp8_linear, quantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_activations_give_the_product_of_quantizing_in_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    w_q, w_scale = quantize_rows(torch.randn(48, 64, generator=gen))
    bias = torch.randn(48, generator=gen).to(dtype)
    want = fp8_linear(x, w_q, w_scale, bias)
    got = fp8_linear(Fp8Activations(*quantize_rows(x), dtype), w_q, w_scale, bias)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(AssertionError, match="static scale"):
        fp8_linear(Fp8Activations(*quantize_rows(x), dtype), w_q, w_scale, None, torch.tensor(1.0))


def _build(cls: type, fp8: Fp8Weights | None) -> torch.nn.Module:
    with parallel_context(ParallelContext(0, 1)):
        if fp8 is None:
            return cls(32, 16)  # type: ignore[no-any-return]
        with quantization_context(fp8):
            return cls(32, 16)  # type: ignore[no-any-return]


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_only_fp8_weights_with_per_token_scales_take_quantized_activations(cls: type) -> None:
    assert _build(cls, Fp8Weights()).takes_fp8_activations
    assert not _build(
        cls, Fp8Weights(from_checkpoint=True, static_activations=True)
    ).takes_fp8_activations  # a checkpoint's static input_scale
    unquantized = _build(cls, None)
    assert not unquantized.takes_fp8_activations
    x = torch.randn(3, 32)
    with pytest.raises(AssertionError, match="unquantized weights"):
        unquantized(Fp8Activations(*quantize_rows(x), x.dtype))


def test_norm_and_swiglu_without_the_kernels_write_plain_rows() -> None:
    # a CPU model's kernel choices have no kernel: the rows go to the product unquantized
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    norm = RMSNorm(32, fp8_output=True)
    assert torch.equal(norm(x), RMSNorm(32)(x))
    normed, total = norm(x, residual)
    assert isinstance(normed, torch.Tensor) and torch.equal(total, x + residual)
    gate_up = torch.randn(3, 64)
    assert torch.equal(SiluAndMul(fp8_output=True)(gate_up), SiluAndMul()(gate_up))
