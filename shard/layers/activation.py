"""Gated activations."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shard.layers import fused

_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None


def _triton_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    # NOTE: imported on the first CUDA call, not at module import, so that CPU-only
    # installs never import Triton.
    global _kernel
    if _kernel is None:
        try:
            module: Any = importlib.import_module("shard.layers.silu_mul_kernel")
        except ImportError:
            return None
        _kernel = module.silu_and_mul
    return _kernel


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    Input ``[..., 2 * d]`` holds ``[gate | up]`` (as produced by the fused gate_up
    projection); output ``[..., d] = silu(gate) * up``. On CUDA our Triton kernel
    (:mod:`shard.layers.silu_mul_kernel`) when Triton imports, else the compiled op.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.stride(-1) == 1 and (kernel := _triton_kernel()) is not None:
            return kernel(x)
        return fused.silu_and_mul(x)
