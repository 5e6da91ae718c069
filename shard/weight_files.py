"""Which files of a model folder hold its weights (torch-free, so that the router can
check a folder before any shard starts)."""

from __future__ import annotations

import json
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of a model folder, in a stable order: those the
    ``model.safetensors.index.json`` names (a sharded checkpoint), else every
    ``*.safetensors``.

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
