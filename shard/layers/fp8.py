"""The fp8 side of the tensor-parallel linear layers (:mod:`shard.layers.linear`): their
scale parameters, and how checkpoint rows and scales land in them.

A layer built with fp8 weights (:func:`~shard.quantization.config.current_fp8_weights`)
holds ``weight [out_local, in_local]`` in float8_e4m3fn and ``weight_scale
[out_local]`` float32, one scale per output channel of this rank; with a checkpoint's
static activation scales also ``input_scale`` (float32 scalar, the largest of the
layer's checkpoint tensors', e.g. of q, k and v).

Sharding the scales: a column-parallel layer (q/k/v, gate/up) splits its output rows,
so its scales are split with them (each rank reads the rows it holds); a row-parallel
layer (o_proj, down_proj) splits the input features and keeps every output row, so it
keeps every scale. A weight quantized at load takes its scales from the rows this rank
holds: a row-parallel rank's scale covers its slice of the inputs, which is at least as
precise as the full row's (each rank's partial product is dequantized before the
all-reduce).

Scales start as NaN: a weight row whose scale neither the quantization at load nor the
checkpoint wrote (an fp8 checkpoint tensor without its ``weight_scale``) is caught after
loading by :func:`missing_scales`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from shard.quantization.config import current_fp8_weights
from shard.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Activations,
    fp8_linear,
    is_fp8,
    quantize_rows_mse,
)

__all__ = [
    "FP8_DTYPE",
    "Fp8Activations",
    "fp8_linear",
    "is_scale",
    "load_scale",
    "missing_scales",
    "scale_params",
    "store_rows",
]


class _Fp8Layer(Protocol):
    weight: nn.Parameter
    weight_scale: nn.Parameter | None
    input_scale: nn.Parameter | None

    def _rows(self, shard_id: Any) -> tuple[int, int, int]: ...


def scale_params(
    out_local: int, loader: Callable[..., None]
) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """(``weight_scale`` [out_local], ``input_scale`` scalar or None), both float32 NaN
    and loaded by ``loader``, for a layer built with fp8 weights; (None, None) otherwise."""
    fp8 = current_fp8_weights()
    if fp8 is None:
        return None, None
    weight_scale = nn.Parameter(
        torch.full((out_local,), float("nan"), dtype=torch.float32), requires_grad=False
    )
    weight_scale.weight_loader = loader  # type: ignore[attr-defined]
    # filled by the weight's own loader when it is quantized at load
    weight_scale.derived_at_load = not fp8.from_checkpoint  # type: ignore[attr-defined]
    input_scale = None
    if fp8.static_activations:
        input_scale = nn.Parameter(
            torch.full((), float("nan"), dtype=torch.float32), requires_grad=False
        )
        input_scale.weight_loader = loader  # type: ignore[attr-defined]
    return weight_scale, input_scale


def is_scale(layer: _Fp8Layer, param: nn.Parameter) -> bool:
    """Whether ``param`` is one of ``layer``'s scale parameters."""
    return param is layer.weight_scale or param is layer.input_scale


def store_rows(
    layer: _Fp8Layer, param: nn.Parameter, offset: int, size: int, piece: torch.Tensor, what: str
) -> None:
    """Write checkpoint rows ``piece`` [size, in_local] at rows ``[offset, offset + size)``
    of ``layer``'s fp8 ``param`` (its weight): copied as they are when already fp8 (their
    scales come with the checkpoint's ``weight_scale``), else quantized per row on the
    weight's device (:func:`~shard.quantization.fp8.quantize_rows_mse`), their scales
    written beside them.

    Raises:
        ValueError: on a shape mismatch.
    """
    target = param.data.narrow(0, offset, size)
    if target.shape != piece.shape:
        raise ValueError(
            f"shape mismatch for {what}: parameter {tuple(target.shape)} vs "
            f"checkpoint slice {tuple(piece.shape)}"
        )
    if is_fp8(piece):
        if piece.dtype != FP8_DTYPE:
            raise ValueError(
                f"{what}: fp8 checkpoint tensors must be float8_e4m3fn, got {piece.dtype}"
            )
        target.copy_(piece)
        return
    assert layer.weight_scale is not None, "store_rows is for fp8 layers"
    q, scale = quantize_rows_mse(piece.to(target.device))
    target.copy_(q)
    layer.weight_scale.data.narrow(0, offset, size).copy_(scale)


def load_scale(layer: _Fp8Layer, param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """Load a checkpoint's ``weight_scale`` (scalar, ``[out]`` or ``[out, 1]``: per
    tensor or per output channel) into the rows of checkpoint tensor ``shard_id``, or
    its ``input_scale`` (scalar; the largest over the layer's tensors is kept).

    Raises:
        ValueError: a scale of another shape.
    """
    full = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
    full = full.to(device=param.device, dtype=torch.float32)
    if param is layer.input_scale:
        if full.numel() != 1:
            raise ValueError(f"input_scale must be one value per tensor, got {tuple(full.shape)}")
        param.data.copy_(torch.fmax(param.data, full.reshape(())))
        return
    offset, size, start = layer._rows(shard_id)
    target = param.data.narrow(0, offset, size)
    if full.numel() == 1:
        target.fill_(full.reshape(()))  # one scale for the tensor: every row's
        return
    rows = full.reshape(-1)
    if full.dim() > 2 or (full.dim() == 2 and full.shape[1] != 1):
        raise ValueError(
            f"weight_scale must be a scalar, [out] or [out, 1]; got "
            f"{tuple(full.shape)} (block-wise scales are not read)"
        )
    target.copy_(rows.narrow(0, start, size))


class _ModelParameters(Protocol):
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


SCALE_NAMES = ("weight_scale", "input_scale")


def missing_scales(model: _ModelParameters) -> list[str]:
    """Names of the fp8 scale parameters of ``model`` never loaded (still NaN): an fp8
    checkpoint tensor without its ``weight_scale``, or a static scheme without an
    ``input_scale``."""
    return [
        name
        for name, param in model.named_parameters()
        if name.rsplit(".", 1)[-1] in SCALE_NAMES and bool(torch.isnan(param).any())
    ]
