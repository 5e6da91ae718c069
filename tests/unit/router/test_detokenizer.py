"""Incremental detokenization with the real tokenizer: CASES S5 and S6."""

from __future__ import annotations

import random

import pytest

from router.detokenizer import IncrementalDetokenizer, generated_text
from router.tokenizer import Tokenizer
from tests.byte_tokens import byte_tokens

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


def _streamed(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return "".join([detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()])


@pytest.mark.parametrize("text", TEXTS)
def test_text_decoded_once_equals_the_streamed_text(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = next(iter(tokenizer.eos_token_ids))
    for cut in (ids, ids[:-1], [*ids, eos]):  # whole, a character cut, ended by EOS
        assert generated_text(tokenizer, prompt, cut) == _streamed(tokenizer, prompt, cut)


def test_text_decoded_once_equals_the_streamed_text_on_random_ids(tokenizer: Tokenizer) -> None:
    # What a model with random weights emits: byte fragments, specials, anything.
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    for _ in range(50):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        assert generated_text(tokenizer, prompt, ids) == _streamed(tokenizer, prompt, ids)


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    # vLLM's text: the decode of prompt + generated minus the prompt's decode ("Hi \ufffd"),
    # so the emoji that the prompt began is the prompt's; the deltas hold no prompt text.
    smile = byte_tokens(tokenizer, "🙂")
    prompt = tokenizer.encode("Hi ", add_special_tokens=False) + smile[:2]
    ok = tokenizer.encode(" ok", add_special_tokens=False)
    for output, pieces in ((smile[2:] + ok, ["", "", " ok"]), (ok, [" ok"]),
                           (smile[2:], ["", ""])):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        assert [detokenizer.add(token_id) for token_id in output] == pieces
        assert detokenizer.flush() == ""
        assert generated_text(tokenizer, prompt, output) == "".join(pieces)


def test_prompt_ending_inside_a_character_on_random_ids(tokenizer: Tokenizer) -> None:
    # Prompts cut inside characters, outputs of byte tokens and random tokens: the streamed
    # text equals the text decoded once, and both equal vLLM's prompt-subtracted decode.
    rng = random.Random(1)
    vocab = tokenizer.vocab_size
    texts = ["🙂", "é", "日本", "👩‍👧", " €x"]
    for _ in range(60):
        whole = byte_tokens(tokenizer, rng.choice(texts))
        cut = whole[:rng.randrange(1, len(whole))]
        prompt = tokenizer.encode("Say", add_special_tokens=False) + cut
        ids = [rng.choice([rng.randrange(vocab), *byte_tokens(tokenizer, rng.choice(texts))])
               for _ in range(rng.randrange(1, 12))]
        full = tokenizer.decode(prompt + ids).rstrip("\ufffd")
        expected = full[len(tokenizer.decode(prompt)):]
        streamed = _streamed(tokenizer, prompt, ids)
        assert streamed == generated_text(tokenizer, prompt, ids) == expected
