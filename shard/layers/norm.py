"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from shard.kernels.choices import current_kernels
from shard.layers import fused
from shard.layers.weight_loader import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))``, computed in float32 and cast back
    to the input dtype before the weight multiply, exactly like Hugging Face Llama.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = current_kernels()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_loader(self.weight, default_weight_loader)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden_size] any float dtype (e.g. [num_tokens, hidden_size], or
        [num_tokens, num_heads, head_dim] for per-head norms) → same shape and dtype.

        With ``residual`` (same shape and dtype) the residual add comes first and its
        sum is returned too: ``(norm(x + residual), x + residual)``, one kernel on CUDA
        (our Triton kernel, :mod:`shard.kernels.rms_norm`, for the rows it takes;
        else the op compiled in :mod:`shard.layers.fused`).
        """
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not x.is_cuda:
            # one fused op; with nothing to cast it is the same arithmetic as rms_norm
            if residual is None:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            total = x + residual
            return F.rms_norm(total, self.weight.shape, self.weight, self.eps), total
        kernel = self.kernels.add_rms_norm
        if x.is_cuda and kernel is not None:
            result = kernel(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
            if result is not None:  # None: rows the kernel does not take
                out, summed = result
                return out if summed is None else (out, summed)
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)
