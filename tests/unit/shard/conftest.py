"""Fixtures: tiny random Hugging Face models saved as safetensors, and their
transformers greedy references (session-scoped: built once per run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.unit.shard.helpers import PROMPTS, hf_greedy, make_hf_model

NEW_TOKENS = 20


@pytest.fixture(scope="session")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, PreTrainedModel]]:
    """``get(variant) -> (folder, transformers model)``, cached per variant."""
    cache: dict[str, tuple[Path, PreTrainedModel]] = {}

    def get(variant: str) -> tuple[Path, PreTrainedModel]:
        if variant not in cache:
            folder = tmp_path_factory.mktemp(variant)
            cache[variant] = (folder, make_hf_model(variant, folder))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def llama(
    tiny_models: Callable[[str], tuple[Path, PreTrainedModel]],
) -> tuple[Path, PreTrainedModel]:
    return tiny_models("llama")


@pytest.fixture(scope="session")
def expected_greedy(llama: tuple[Path, PreTrainedModel]) -> list[list[int]]:
    """transformers greedy tokens (NEW_TOKENS each) for every prompt in PROMPTS."""
    _, model = llama
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
