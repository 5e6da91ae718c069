"""Load Hugging Face safetensors checkpoints (single file or sharded with
``model.safetensors.index.json``) into a model whose parameters carry weight loaders,
or fill dummy weights from the config alone.

Tensors are handed to the loaders as lazy safetensors slices, so a tensor-parallel rank
reads only its own rows or columns from disk (see :mod:`shard.layers.weight_loader`). fp8
checkpoint tensors reach fp8 parameters as they are; unquantized ones are quantized by
the fp8 layers' loaders (:mod:`shard.layers.fp8`)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors import safe_open

from shard.layers.fp8 import missing_scales
from shard.layers.weight_loader import get_checkpoint_shapes, get_weight_loader
from shard.models.base import CausalLM
from shard.weight_files import safetensors_files

# fp8 checkpoints' KV cache scales (``self_attn.k_scale`` ...): not read, the fp8 KV
# cache computes a scale per token and head as it writes (shard/kv_cache.py)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, lazy slice)`` for every tensor of every file.

    A lazy slice (safetensors ``PySafeSlice``) has ``get_shape()`` and reads from disk
    (to CPU) only the range it is indexed with, e.g. ``s[0:128]`` or ``s[:, 64:128]``;
    it is valid until the next item is requested.
    """
    for i, file in enumerate(files):
        logger.info("loading weights file {}/{}: {}", i + 1, len(files), file.name)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: CausalLM, path: str | Path) -> int:
    """Load every checkpoint tensor through its parameter's ``weight_loader``.

    Returns:
        number of checkpoint tensors loaded.

    Raises:
        FileNotFoundError: no safetensors files.
        ValueError: a checkpoint tensor matches no parameter, a shape mismatches, a
            parameter received no tensor, or an fp8 weight came without its scale.
    """
    params = dict(model.named_parameters())
    # an fp8 weight quantized at load writes its scales itself
    loaded = {n for n, p in params.items() if getattr(p, "derived_at_load", False)}
    count = 0
    for name, tensor in iterate_tensors(safetensors_files(path)):
        target = model.map_checkpoint_name(name)
        if target is None or name.endswith(KV_SCALE_SUFFIXES):
            continue
        param_name, shard_id = target
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
        param = params[param_name]
        loader = get_weight_loader(param)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"loading {name!r}: {exc}") from exc
        loaded.add(param_name)
        count += 1
    missing = sorted(set(params) - loaded) or missing_scales(model)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for: {', '.join(missing[:10])}")
    logger.info("loaded {} tensors into {} parameters", count, len(params))
    return count


def fill_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02,
                       dtype: torch.dtype | None = None) -> None:
    """Random weights for benchmarks: norms = 1, biases = 0, others ~ N(0, std²).

    Each full (unsharded) checkpoint tensor is drawn from a generator seeded by
    ``seed`` and its name on the parameter's device, then passed through the
    parameter's ``weight_loader``: every rank of a shard group gets its slice of the
    same full model, so TP=N dummy weights equal TP=1's on the same device type. fp8
    weights are drawn in ``dtype`` (the model's; None: float32) and quantized by their
    loaders, which write their scales; the same seed gives the unquantized model's
    values.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if name.endswith(".bias"):
            param.data.zero_()
            continue
        if getattr(param, "derived_at_load", False):
            continue  # an fp8 weight's scales: written when the weight is loaded
        loader = get_weight_loader(param)
        draw = param.dtype if param.dtype.itemsize > 1 else (dtype or torch.float32)
        for shard_id, shape in get_checkpoint_shapes(param):
            key = f"{name}:{shard_id}".encode()
            gen = torch.Generator(device=param.device).manual_seed(seed + zlib.crc32(key))
            full = torch.randn(shape, generator=gen, dtype=draw, device=param.device)
            full.mul_(std)
            if shard_id is None:
                loader(param, full)
            else:
                loader(param, full, shard_id)
