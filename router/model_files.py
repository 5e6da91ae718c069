"""Where the model comes from: a Hugging Face folder, or the default model converted once.

The conversion needs torch and transformers, which the router never imports, so it runs
in a child process (``python -m shard.convert``), whose progress bars show on the console.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from router.config import default_cache_dir

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_MARKER = "shardserve-converted.json"


@dataclass(frozen=True)
class ModelFiles:
    """A model folder (config.json, safetensors, tokenizer files) and the id it is served as."""

    path: Path
    model_id: str


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Folder the default model is converted into."""
    return (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_DIR_NAME


def prepare_default_model(cache_dir: Path | None = None) -> ModelFiles:
    """Convert the default model on first use; reuse the folder afterwards.

    Raises:
        RuntimeError: the conversion failed (its output says why).
    """
    dest = default_model_dir(cache_dir)
    if not (dest / _CONVERTED_MARKER).exists():
        result = subprocess.run([sys.executable, "-m", "shard.convert", str(dest)], check=False)
        if result.returncode != 0:
            raise RuntimeError(f"converting the default model into {dest} failed")
    return ModelFiles(path=dest, model_id=DEFAULT_MODEL_ID)


def resolve_model(model: str | None, model_id: str | None = None) -> ModelFiles:
    """The folder to serve: ``model`` if given, else the default model.

    Raises:
        FileNotFoundError: ``model`` is not a folder with a ``config.json``.
    """
    if model is None:
        files = prepare_default_model()
        return ModelFiles(files.path, model_id or files.model_id)
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model {model}: expected a Hugging Face model folder with config.json"
        )
    return ModelFiles(path=path, model_id=model_id or path.name)
