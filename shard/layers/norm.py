"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from shard.kernels.choices import current_kernels
from shard.layers import fused
from shard.layers.weight_loader import default_weight_loader, set_weight_loader
from shard.quantization.fp8 import Fp8Activations

# the normalised rows: in x's dtype, or quantized per token for an fp8 product
Normed = torch.Tensor | Fp8Activations


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))``, computed in float32 and cast back
    to the input dtype before the weight multiply, exactly like Hugging Face Llama.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        fp8_output: the next product has fp8 weights that take activations quantized
            per token (:attr:`~shard.layers.linear.ParallelLinearBase.takes_fp8_activations`):
            where the model's kernel choices have our fused kernel
            (:func:`shard.kernels.rms_norm.add_rms_norm_fp8`), the normalised rows come
            out quantized (:class:`~shard.quantization.fp8.Fp8Activations`) instead.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, fp8_output: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fp8_output = fp8_output
        self.kernels = current_kernels()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_loader(self.weight, default_weight_loader)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> Normed: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[Normed, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Normed | tuple[Normed, torch.Tensor]:
        """x: [..., hidden_size] any float dtype (e.g. [num_tokens, hidden_size], or
        [num_tokens, num_heads, head_dim] for per-head norms) → same shape and dtype.

        With ``residual`` (same shape and dtype) the residual add comes first and its
        sum is returned too: ``(norm(x + residual), x + residual)``, one kernel on CUDA
        (our Triton kernel, :mod:`shard.kernels.rms_norm`, for the rows it takes;
        else the op compiled in :mod:`shard.layers.fused`).

        Built with ``fp8_output``, the normalised rows come quantized per token where our
        fused kernel runs: the model's kernel choices have it (on CUDA only,
        :meth:`~shard.kernels.choices.KernelChoices.load`) and it takes the rows.
        """
        quantized = self._quantized(x, residual)
        if quantized is not None:
            return quantized
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

    def _quantized(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Fp8Activations | tuple[Fp8Activations, torch.Tensor] | None:
        """The fused kernel's (quantized rows, the sum when ``residual`` is given), or None
        where it does not run (see :meth:`forward`).

        NOTE: not gated on ``x.is_cuda``, unlike the kernel of the unquantized rows: the
        choices hold the kernel on CUDA only, and a test may hand it to a CPU model
        (Triton's interpreter)."""
        kernel = self.kernels.add_rms_norm_fp8
        if not self.fp8_output or kernel is None:
            return None
        result = kernel(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
        if result is None:  # rows the kernel does not take
            return None
        q, scale, summed = result
        quantized = Fp8Activations(q, scale, x.dtype)
        return quantized if summed is None else (quantized, summed)
