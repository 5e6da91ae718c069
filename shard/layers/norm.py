"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard.layers.linear import default_weight_loader, set_weight_loader


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
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] any float dtype (e.g. [num_tokens, hidden_size], or
        [num_tokens, num_heads, head_dim] for per-head norms) → same shape and dtype."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op; with nothing to cast it is the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)
