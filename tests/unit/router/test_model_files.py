"""Model resolution: a folder, or a repository id in the Hugging Face cache (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.model_files import resolve_model


def write_model(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))


def test_folder(tmp_path: Path) -> None:
    write_model(tmp_path / "my-model")
    files = resolve_model(str(tmp_path / "my-model"))
    assert files.path == (tmp_path / "my-model").resolve() and files.model_id == "my-model"


def test_repository_in_the_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    write_model(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    files = resolve_model("acme/tiny-llama")
    assert files.path == repo / "snapshots" / "0123abcd"
    assert files.model_id == "acme/tiny-llama"


def test_missing_model_names_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--model"):
        resolve_model("acme/not-there")
    with pytest.raises(FileNotFoundError, match="--model"):
        resolve_model(str(tmp_path / "nowhere"))
