"""What the shard needs of a model: the :class:`CausalLM` protocol that the registry,
the loaders, the model runner and the decode CUDA graphs program against."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from shard.attention.base import AttentionBackend
from shard.attention.layer import Attention
from shard.attention.metadata import AttentionMetadata
from shard.models.config import ModelConfig


class CausalLM(Protocol):
    """A decoder-only language model over flattened tokens and a paged KV cache.

    An implementation is an ``nn.Module`` whose parameters carry their own
    ``weight_loader`` (see :mod:`shard.layers.weight_loader`), built inside
    :func:`~shard.distributed.parallel_context` for its tensor-parallel rank.
    """

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 → hidden [num_tokens, hidden_size]
        (model dtype)."""
        ...

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """hidden [n, hidden_size] → logits [n, vocab_size] in ``dtype`` (None: the
        model's dtype, uncast; full vocabulary on every rank)."""
        ...

    def attention_layers(self) -> list[Attention]:
        """The per-layer :class:`Attention` modules, in layer order (to bind the KV cache)."""
        ...

    def map_checkpoint_name(self, name: str) -> tuple[str, str | int | None] | None:
        """Checkpoint tensor name → (parameter name, shard id or None), or None to skip."""
        ...

    def fused_decode_rows(self) -> Mapping[int, range]:
        """Per weight whose product a fused kernel takes over at decode sizes, by the
        weight's ``data_ptr()``, the row counts (tokens) at which that product never
        runs as a matrix product; weights always multiplied are left out. The warm-up's
        GEMM tuning skips those products (:func:`shard.kernels.gemm_tuning.tune`'s
        ``decode_elsewhere``)."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> Any: ...


# How the registry builds a model: ``cls(config, backend)``.
ModelClass = Callable[[ModelConfig, AttentionBackend], CausalLM]
