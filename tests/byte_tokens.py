"""Byte-level tokens of a text, one per UTF-8 byte (to cut a character between tokens)."""

from __future__ import annotations

from router.tokenizer import Tokenizer


def byte_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """One byte-level BPE token per UTF-8 byte of ``text``, through GPT-2's byte-to-
    character map (the default model's tokenizer has a token for each byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    ids = [tokenizer.backend.token_to_id(chars[b]) for b in text.encode()]
    assert None not in ids, "the tokenizer should have a token for every byte"
    return [i for i in ids if i is not None]
