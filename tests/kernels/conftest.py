"""Kernel tests: on a machine without CUDA, Triton kernels run in its CPU interpreter.

NOTE: ``TRITON_INTERPRET`` must be set before ``triton.jit`` decorates our kernels, so it
is set here, before any test module imports them (the registry imports them lazily).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-ups in these tests neither read nor write the user's cache (GEMM tuning)."""
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernels: attention kernels and backend selection (pytest -m kernels)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.kernels)
