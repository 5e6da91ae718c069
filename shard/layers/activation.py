"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from shard.kernels.choices import current_kernels
from shard.layers import fused


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``. On CUDA our Triton kernel
    (:mod:`shard.kernels.silu_mul`) where the model's kernel choices have it, else the
    compiled op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels = current_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.silu_and_mul
        if x.is_cuda and x.stride(-1) == 1 and kernel is not None:
            return kernel(x, pdl=self.kernels.pdl)
        return fused.silu_and_mul(x)
