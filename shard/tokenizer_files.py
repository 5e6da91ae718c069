"""What a Hugging Face model folder says about its tokenizer's special tokens, read one
way by the router (its :class:`router.tokenizer.Tokenizer`) and the shard (grammar
masks), so that both count the same ids as ending generation. Torch-free: part of the
router's contract (tests/unit/router/test_contract.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when the file is missing or not an object."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(folder: Path, token_to_id: Callable[[str], int | None]) -> frozenset[int]:
    """Every token id that ends generation: the ``eos_token_id`` of
    generation_config.json and config.json (an id or a list), and the id of
    tokenizer_config.json's ``eos_token`` (looked up with ``token_to_id``)."""
    ids = _ids(read_json(folder / "generation_config.json").get("eos_token_id"))
    ids |= _ids(read_json(folder / "config.json").get("eos_token_id"))
    eos = token_text(read_json(folder / "tokenizer_config.json").get("eos_token"))
    if eos is not None and (eos_id := token_to_id(eos)) is not None:
        ids.add(int(eos_id))
    return frozenset(ids)
