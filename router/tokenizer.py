"""The model's tokenizer, loaded with the Hugging Face ``tokenizers`` library.

The router must not import torch, and ``transformers`` does; so the router reads
``tokenizer.json`` directly and takes special tokens from ``tokenizer_config.json``,
``generation_config.json`` and ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from shard.tokenizer_files import eos_token_ids, read_json, token_text


@dataclass
class Tokenizer:
    """Encoder/decoder plus the special tokens generation needs.

    Attributes:
        backend: The ``tokenizers.Tokenizer`` read from ``tokenizer.json``.
        eos_token_ids: Every id that ends generation (generation_config, config and the
            tokenizer's ``eos_token`` together).
        bos_token: Text of the BOS token, if any.
        chat_template: Jinja template from ``chat_template.jinja`` or tokenizer_config.
    """

    backend: HFTokenizer
    eos_token_ids: frozenset[int]
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load from a Hugging Face model folder.

        Raises:
            FileNotFoundError: the folder has no ``tokenizer.json``.
        """
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} not found (a fast tokenizer is required)")
        backend = HFTokenizer.from_file(str(tokenizer_file))
        tok_config = read_json(folder / "tokenizer_config.json")
        eos_token = token_text(tok_config.get("eos_token"))
        eos_ids = eos_token_ids(folder, backend.token_to_id)

        template_file = folder / "chat_template.jinja"
        chat_template = (
            template_file.read_text() if template_file.exists() else tok_config.get("chat_template")
        )
        return cls(
            backend=backend,
            eos_token_ids=eos_ids,
            bos_token=token_text(tok_config.get("bos_token")),
            eos_token=eos_token,
            chat_template=chat_template if isinstance(chat_template, str) else None,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens per the tokenizer's post-processor."""
        return list(self.encoding(text, add_special_tokens).ids)

    def encoding(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """The full encoding of ``text``: ids and character offsets ``(start, stop)``.

        NOTE: ``tokenizers``' ``encode`` holds the GIL for the whole call (0.7 s for
        1 MiB of text), so running it in a worker thread would still stop the event
        loop; ``encode_batch`` releases the GIL while it works, so it is used even for
        one text.
        """
        encodings = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encodings[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` ('' when out of range)."""
        return self.backend.id_to_token(token_id) or ""

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (added, control) token."""
        return token_id in self.special_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (added, control) tokens."""
        cached: frozenset[int] | None = self.__dict__.get("_special_cache")
        if cached is None:
            cached = frozenset(
                token_id
                for token_id, added in self.backend.get_added_tokens_decoder().items()
                if added.special
            )
            self.__dict__["_special_cache"] = cached
        return cached

    @property
    def max_token_chars(self) -> int:
        """Most characters one token can stand for (the longest vocabulary entry; for
        byte-level vocabularies an entry has one character per byte, an upper bound)."""
        cached: int | None = self.__dict__.get("_max_token_chars")
        if cached is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            cached = max((len(token) for token in vocab), default=1)
            self.__dict__["_max_token_chars"] = cached
        return cached

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))
