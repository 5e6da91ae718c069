"""Where the model runner keeps the warm-up's GEMM tuning results: ``--gemm-tuning-cache``
(``~`` expanded), else ``$SHARDSERVE_CACHE_DIR/gemm-tuning``, else
``$XDG_CACHE_HOME/shardserve/gemm-tuning``, else ``~/.cache/shardserve/gemm-tuning``; one
file per GPU identity; nothing kept (a warning, no error) where no folder resolves or
cuBLASLt cannot be loaded.

The GPU's identity is stubbed (it needs CUDA); the runner is the tiny CPU model's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from shard.config import ShardConfig
from shard.kernels import tuning_cache
from shard.model_runner import ModelRunner
from tests.unit.shard.helpers import BLOCK_SIZE, DEVICE

IDENTITY: dict[str, Any] = {"format": 1, "device": "NVIDIA H200", "sms": 132,
                            "capability": "9.0", "cublaslt": 130100, "cuda": "13.0",
                            "torch": "2.11.0"}


@pytest.fixture
def runner_with(llama, monkeypatch: pytest.MonkeyPatch) -> Callable[..., ModelRunner]:
    monkeypatch.setattr(tuning_cache, "cache_identity", lambda device: IDENTITY)
    for name in ("SHARDSERVE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def make(gemm_tuning_cache: str = "") -> ModelRunner:
        return ModelRunner(ShardConfig(
            model_path=str(llama[0]), device=DEVICE, dtype="float32", block_size=BLOCK_SIZE,
            kv_cache_bytes=1 << 20, gemm_tuning_cache=gemm_tuning_cache))

    return make


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    captured: list[str] = []
    sink = logger.add(captured.append, level="WARNING", format="{message}")
    yield captured
    logger.remove(sink)


def _tuning_cache(runner: ModelRunner) -> tuning_cache.TuningCache | None:
    return tuning_cache.cache_for(runner.config, runner.device, runner.log)


def _placed(runner: ModelRunner) -> Path:
    cache = _tuning_cache(runner)
    assert cache is not None
    assert cache.identity == IDENTITY
    return cache.path


def test_the_flag_names_the_folder_with_home_expanded(
    runner_with, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "unused"))
    path = _placed(runner_with("~/tuning"))
    assert path.parent == tmp_path / "tuning"
    assert path == tuning_cache.cache_file(tmp_path / "tuning", IDENTITY)
    assert path.name.startswith("NVIDIA-H200-") and path.suffix == ".json"


def test_without_the_flag_the_cache_folder_of_the_environment(
    runner_with, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _placed(runner_with()).parent == tmp_path / "xdg" / "shardserve" / "gemm-tuning"
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "ours"))  # comes first
    assert _placed(runner_with()).parent == tmp_path / "ours" / "gemm-tuning"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("SHARDSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _placed(runner_with()).parent == tmp_path / "home" / ".cache" / "shardserve" / \
        "gemm-tuning"


def test_no_home_folder_keeps_nothing_with_a_warning(
    runner_with, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert _tuning_cache(runner_with()) is None
    assert any("GEMM tuning results not kept" in w and "home" in w for w in warnings)


def test_no_cublaslt_keeps_nothing(runner_with, monkeypatch: pytest.MonkeyPatch,
                                   tmp_path: Path) -> None:
    def missing(device: object) -> dict[str, Any]:
        raise OSError("libcublasLt.so: cannot open shared object file")

    monkeypatch.setattr(tuning_cache, "cache_identity", missing)
    assert _tuning_cache(runner_with(str(tmp_path))) is None
