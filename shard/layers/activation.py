"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from shard.layers import fused


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(x)
