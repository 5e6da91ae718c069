"""Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv:2104.09864).

Numerics follow Hugging Face: inverse frequencies and cos/sin are computed in float32,
cast to the activation dtype, and applied with the ``rotate_half`` convention (the two
halves of head_dim are the pair dimensions, not interleaved even/odd lanes).

Scalings:
  - ``linear`` (position interpolation, Chen et al. 2023): inv_freq / factor.
  - ``llama3`` (Meta, Llama 3.1 release, 2024): long wavelengths divided by ``factor``,
    short ones kept, a smooth interpolation between ``low_freq_factor`` and
    ``high_freq_factor`` wavelengths.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shard.layers.fused import apply_rotary
from shard.models.config import RopeConfig

__all__ = ["RotaryEmbedding", "apply_rotary", "compute_inv_freq"]


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 for the given rope settings.

    Raises:
        ValueError: on an unknown rope type.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"unknown rope_type {rope.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE angles of arbitrary (flattened) positions, applied by
    :func:`shard.layers.fused.apply_rotary`.

    cos/sin are computed on the fly from ``positions`` (one multiply per element, so no
    table bounded by max_position_embeddings is kept), once per forward for all layers.

    Args:
        head_dim: rotary dimension (the full head dimension).
        rope: rope settings.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's angles (computed once per forward by the model and
        shared by its layers; see :func:`apply_rotary`).

        Args:
            positions: [num_tokens] int64, absolute position of each token.
            dtype: dtype of the queries and keys they will rotate.

        Returns:
            (cos, sin), each [num_tokens, 1, head_dim] in ``dtype``.
        """
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
