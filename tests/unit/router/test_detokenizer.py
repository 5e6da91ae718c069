"""Incremental detokenization with the real tokenizer: CASES S5 and S6."""

from __future__ import annotations

import pytest

from router.detokenizer import IncrementalDetokenizer
from router.tokenizer import Tokenizer

TEXTS = [
    " Hello world, this is a test of leading spaces.",
    "  two  spaces   and\ttabs\nnew lines",
    " café naïve résumé — «quotes»",
    " 日本語のテキストと中文字符",
    " emoji 🤗🎉👩‍👩‍👧 done",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token_id) for token_id in ids]
    pieces.append(detokenizer.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_multibyte_character_waits_for_its_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🤗", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    pieces = [detokenizer.add(token_id) for token_id in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🤗"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    eos = next(iter(tokenizer.eos_token_ids))
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert detokenizer.add(tokenizer.encode(" a", add_special_tokens=False)[0]) == " a"
    assert detokenizer.add(eos) == ""


def test_character_cut_by_the_token_limit_is_dropped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ok 🤗", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    pieces = [detokenizer.add(token_id) for token_id in ids[:-1]]  # the emoji's last byte
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == " ok " and all("\ufffd" not in p for p in pieces)
