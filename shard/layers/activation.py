"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
