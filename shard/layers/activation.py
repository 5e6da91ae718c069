"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from shard.layers import fused


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``. On CUDA our Triton kernel
    (:mod:`shard.layers.silu_mul_kernel`) when Triton imports, else the compiled op.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.stride(-1) == 1:
            kernel = fused.triton_kernel("shard.layers.silu_mul_kernel", "silu_and_mul")
            if kernel is not None:
                out: torch.Tensor = kernel(x)
                return out
        return fused.silu_and_mul(x)
