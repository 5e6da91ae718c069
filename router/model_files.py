"""Where the model comes from: a Hugging Face folder, or the default model converted once.

The conversion needs torch and transformers, which the router never imports, so it runs
in a child process (``python -m shard.convert``), whose progress bars show on the console.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shard.config import default_cache_dir
from shard.default_model import DEFAULT_MODEL_ID, is_converted
from shard.weight_files import safetensors_files

DEFAULT_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"


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
    if not is_converted(dest):
        result = subprocess.run([sys.executable, "-m", "shard.convert", str(dest)], check=False)
        if result.returncode != 0:
            raise RuntimeError(f"converting the default model into {dest} failed")
    return ModelFiles(path=dest, model_id=DEFAULT_MODEL_ID)


def from_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of ``repo_id`` in the local Hugging Face cache, offline.

    Honours ``HF_HOME`` / ``HF_HUB_CACHE``; never downloads.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def resolve_model(model: str | None, flag: str = "--model") -> ModelFiles:
    """The folder to serve: ``model`` as a folder (e.g. a mounted volume) or as a
    repository id already in the Hugging Face cache; the default model when ``None``.
    ``model_id`` is the name it is served as unless ``--served-model-name`` says
    otherwise: the folder's name, the repository id, or the default model's id.

    Raises:
        FileNotFoundError: ``model`` is neither a folder with a ``config.json`` nor a
            repository in the local Hugging Face cache (the message names ``flag``).
    """
    if model is None:
        return prepare_default_model()
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return ModelFiles(path=path.resolve(), model_id=path.resolve().name)
    if not path.exists() and model.count("/") == 1:
        snapshot = from_hf_cache(model)
        if snapshot is not None and (snapshot / "config.json").exists():
            return ModelFiles(path=snapshot, model_id=model)
    raise FileNotFoundError(
        f"{flag} {model}: expected a Hugging Face model folder with config.json, or a "
        "repository id present in the local Hugging Face cache (downloads are not made)"
    )



def check_weights(folder: Path, flag: str) -> None:
    """Raise unless ``folder`` holds safetensors weights (what the shards load unless
    ``--load-format dummy``; :func:`shard.weight_files.safetensors_files`): before any
    shard starts, naming ``flag``.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``folder``.
    """
    try:
        safetensors_files(folder)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{flag} {folder}: {error}") from None
