"""Load Hugging Face safetensors checkpoints (single file or sharded with
``model.safetensors.index.json``) into a model whose parameters carry weight loaders,
or fill dummy weights from the config alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from loguru import logger
from safetensors import safe_open
from torch import nn

from shard.layers.linear import get_weight_loader
from shard.models.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of a model folder, in a stable order.

    Raises:
        FileNotFoundError: when the folder has no ``*.safetensors``.
    """
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.exists():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder} (use --load-format dummy for random weights)"
        )
    return files


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file (on CPU)."""
    for i, file in enumerate(files):
        logger.info("loading weights file {}/{}: {}", i + 1, len(files), file.name)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: LlamaForCausalLM, path: str | Path) -> int:
    """Load every checkpoint tensor through its parameter's ``weight_loader``.

    Returns:
        number of checkpoint tensors loaded.

    Raises:
        FileNotFoundError: no safetensors files.
        ValueError: a checkpoint tensor matches no parameter, a shape mismatches, or a
            parameter received no tensor.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    count = 0
    for name, tensor in iterate_tensors(safetensors_files(path)):
        target = model.map_checkpoint_name(name)
        if target is None:
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
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for: {', '.join(missing[:10])}")
    logger.info("loaded {} tensors into {} parameters", count, len(params))
    return count


def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks: norms = 1, biases = 0, others ~ N(0, std²).

    Seeded on CPU so every rank and device gets the same values.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.data.copy_(values.to(param.dtype))
