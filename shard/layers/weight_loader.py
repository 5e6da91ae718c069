"""How a parameter loads itself from a checkpoint.

Every parameter carries ``weight_loader(param, loaded[, shard_id])``; ``loaded`` is a
``torch.Tensor`` or a lazy safetensors slice (``get_shape()`` + ``[a:b]`` indexing), so
each tensor-parallel rank reads only its own rows/columns from the checkpoint (see
:mod:`shard.weights`). Every parameter also carries ``checkpoint_shapes``: the full
(unsharded) checkpoint shape per shard id, used to fill dummy weights sharded exactly
like real ones.

Here: attaching and reading both attributes, reading a range of a tensor or lazy slice,
and the loader of unsharded parameters. The sharded loaders live with their layers
(:mod:`shard.layers.linear`, :mod:`shard.layers.vocab_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[..., None]
# (shard id or None, full checkpoint shape)
CheckpointShapes = list[tuple[Any, tuple[int, ...]]]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach ``loader`` to ``param`` as ``param.weight_loader``."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's ``weight_loader``, or :func:`default_weight_loader`."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def set_checkpoint_shapes(param: nn.Parameter, shapes: CheckpointShapes) -> None:
    """Record the full checkpoint tensors ``param`` is loaded from (see module doc)."""
    param.checkpoint_shapes = shapes  # type: ignore[attr-defined]


def get_checkpoint_shapes(param: nn.Parameter) -> CheckpointShapes:
    """``param.checkpoint_shapes``, or ``[(None, param.shape)]`` for unsharded ones."""
    shapes: CheckpointShapes = getattr(param, "checkpoint_shapes", [(None, tuple(param.shape))])
    return shapes


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_range(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[start:start+size]`` along ``dim`` (0 or 1), read from disk only for that
    range when ``loaded`` is a lazy slice. Rows past the end are not read (the result
    may be shorter than ``size``)."""
    end = min(start + size, loaded_shape(loaded)[dim])
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, max(end - start, 0))
    index = (slice(start, end),) if dim == 0 else (slice(None), slice(start, end))
    out: torch.Tensor = loaded[index]
    return out


def read_all(loaded: Any) -> torch.Tensor:
    """The whole tensor (for unsharded parameters such as norms)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    out: torch.Tensor = loaded[:]
    return out


def copy_piece(target: torch.Tensor, piece: torch.Tensor, what: str) -> None:
    """Copy checkpoint slice ``piece`` into ``target`` (a view of a parameter).

    Raises:
        ValueError: on a shape mismatch, naming ``what`` was loaded.
    """
    if target.shape != piece.shape:
        raise ValueError(
            f"shape mismatch for {what}: parameter {tuple(target.shape)} vs "
            f"checkpoint slice {tuple(piece.shape)}"
        )
    target.copy_(piece)


def default_weight_loader(param: nn.Parameter, loaded: Any) -> None:
    """Copy a full (unsharded) tensor into ``param``.

    Raises:
        ValueError: on a shape mismatch.
    """
    if tuple(param.shape) != loaded_shape(loaded):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {loaded_shape(loaded)}"
        )
    param.data.copy_(read_all(loaded))
