"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted into a Hugging Face folder (cached across runs)."""
    from router.model_files import prepare_default_model

    return prepare_default_model().path


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):  # type: ignore[no-untyped-def]
    """The default model's tokenizer, as the router loads it."""
    from router.tokenizer import Tokenizer

    return Tokenizer.from_folder(default_model_dir)
