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


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """Raise unless the draft model in ``draft`` tokenizes as the served model in
    ``target`` does: the same token → id map (added tokens included) in their
    ``tokenizer.json``. A draft's guesses are token ids of the served model's vocabulary.

    Raises:
        ValueError: a folder has no tokenizer.json, or the vocabularies differ (the
            message counts the differences and names a few).
    """
    vocabularies = []
    for folder in (target, draft):
        data = read_json(folder / "tokenizer.json")
        if not data:
            raise ValueError(f"--speculative-model: {folder} has no tokenizer.json to compare")
        vocab = dict(data.get("model", {}).get("vocab", {}) or {})
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        vocabularies.append(vocab)
    served, guessing = vocabularies
    differ = sorted(t for t in served.keys() | guessing.keys() if served.get(t) != guessing.get(t))
    if differ:
        raise ValueError(
            f"--speculative-model: the draft model's vocabulary differs from the served "
            f"model's in {len(differ)} token{'s' if len(differ) > 1 else ''} "
            f"(e.g. {differ[:3]}): its guesses would be other tokens; use a draft with the "
            "same tokenizer")
