"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from shard.kernels.choices import current_kernels
from shard.layers import fused
from shard.quantization.fp8 import Fp8Activations


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``. On CUDA our Triton kernel
    (:mod:`shard.kernels.silu_mul`) where the model's kernel choices have it, else the
    compiled op.

    Args:
        fp8_output: the next product has fp8 weights that take activations quantized
            per token (:attr:`~shard.layers.linear.ParallelLinearBase.takes_fp8_activations`):
            where the model's kernel choices have our fused kernel
            (:func:`shard.kernels.silu_mul.silu_and_mul_fp8`, on CUDA only) and it takes
            the rows, the output comes quantized
            (:class:`~shard.quantization.fp8.Fp8Activations` of ``[num_tokens, d]``).
    """

    def __init__(self, fp8_output: bool = False) -> None:
        super().__init__()
        self.fp8_output = fp8_output
        self.kernels = current_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activations:
        # NOTE: the fp8 kernel is not gated on x.is_cuda: the choices hold it on CUDA
        # only, and a test may hand it to a CPU model (Triton's interpreter)
        fp8_kernel = self.kernels.silu_and_mul_fp8
        if self.fp8_output and fp8_kernel is not None:
            result = fp8_kernel(x, pdl=self.kernels.pdl)
            if result is not None:  # None: rows the kernel does not take
                return Fp8Activations(*result, x.dtype)
        kernel = self.kernels.silu_and_mul
        if x.is_cuda and x.stride(-1) == 1 and kernel is not None:
            return kernel(x, pdl=self.kernels.pdl)
        return fused.silu_and_mul(x)
