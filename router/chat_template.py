"""Chat templates: render OpenAI-style messages into a prompt, without transformers.

The template comes from the model's tokenizer files (``chat_template.jinja`` or
``tokenizer_config.json``; see :class:`router.tokenizer.Tokenizer`) and is rendered the
way transformers' ``apply_chat_template`` renders it: Jinja2 in an immutable sandbox,
``trim_blocks`` and ``lstrip_blocks``, with ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and a ``raise_exception`` helper.

BOS appears once: a template that writes the BOS token itself is tokenized without the
tokenizer's own special tokens (see :func:`encode_chat_prompt`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' filter: keep non-ASCII characters as they are.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render ``messages`` (``[{"role", "content"}, ...]``) with the model's template;
    ``tools`` (OpenAI tool objects) are passed as the template's ``tools`` variable, as
    transformers does.

    Raises:
        ChatTemplateError: the model has no chat template, or rendering failed.
    """
    if tokenizer.chat_template is None:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        return str(
            _compile(tokenizer.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=tokenizer.bos_token or "",
                eos_token=tokenizer.eos_token or "",
            )
        )
    except ChatTemplateError:
        raise
    except TemplateError as error:
        raise ChatTemplateError(f"chat template failed: {error}") from error


def encode_chat_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of a rendered chat prompt with BOS exactly once.

    A template that starts with the BOS text already wrote it, so the tokenizer must not
    add another; otherwise its post-processor adds BOS as for any prompt.
    """
    bos = tokenizer.bos_token
    writes_bos = bool(bos) and prompt.startswith(bos or "")
    ids = tokenizer.encode(prompt, add_special_tokens=not writes_bos)
    bos_id = tokenizer.backend.token_to_id(bos) if bos else None
    while bos_id is not None and len(ids) > 1 and ids[0] == bos_id and ids[1] == bos_id:
        ids = ids[1:]
    return ids
