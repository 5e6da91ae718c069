"""The route hint of a call (:class:`~router.serve.affinity.RouteHint`): its prompt's
block digests, computed as a replica's prefix cache computes them, and the
conversation it names.

The prompt is tokenized as the replica's validator tokenizes it: ``/generate``'s
``inputs`` and a completion's ``prompt`` with the tokenizer's special tokens (a prompt of
token ids as it is), ``parameters.truncate`` keeping the last tokens; a chat's messages
rendered with the model's chat template (tools as the replica renders them) and
encoded with BOS once (:func:`~router.chat_template.encode_chat_prompt`). A body the
replica will refuse gets no digests: the hint only steers, the replica validates.
"""

from __future__ import annotations

import json
from typing import Any

from loguru import logger

from router.block_manager import block_hashes
from router.chat_template import encode_chat_prompt, render_chat
from router.serve.affinity import RouteHint
from router.serve.config import CONVERSATION_HEADER
from router.tokenizer import Tokenizer

# Routes whose body holds a TGI ``inputs`` prompt, an OpenAI ``prompt``, chat messages.
TGI_PATHS = frozenset({"/generate", "/generate_stream", "/"})
COMPLETION_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# Characters of a prompt tokenized for routing at most (a longer prompt is routed by
# its head: digests are of leading blocks, and the head decides the match).
MAX_ROUTED_CHARS = 64 * 1024


class HintMaker:
    """Route hints for HTTP bodies and public gRPC requests.

    Args:
        tokenizer: The replicas' tokenizer (same model folder).
        block_size: The replicas' KV block size, tokens (``--block-size``).
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def for_http(self, path: str, body: bytes, headers: dict[str, str]) -> RouteHint | None:
        """The hint of an HTTP call to ``path`` with JSON ``body`` (None for a route
        that generates nothing, e.g. ``/info``); ``headers`` with lower-case names."""
        if path not in TGI_PATHS and path not in (COMPLETION_PATH, CHAT_PATH):
            return None
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return RouteHint(conversation=headers.get(CONVERSATION_HEADER))
        conversation = headers.get(CONVERSATION_HEADER) or _text(data.get("user"))
        try:
            ids = self._prompt_ids(path, data)
        except Exception as error:  # the replica will say what is wrong, naming the field
            logger.debug("no route digests for a call to {}: {}", path, error)
            ids = None
        digests = tuple(block_hashes(ids, self.block_size)) if ids else ()
        return RouteHint(digests, conversation)

    def for_grpc(self, inputs: str, truncate: int | None, conversation: str | None) -> RouteHint:
        """The hint of a public gRPC ``Generate`` / ``GenerateStream`` request."""
        ids = self._truncated(self.tokenizer.encode(inputs[:MAX_ROUTED_CHARS]), truncate)
        return RouteHint(tuple(block_hashes(ids, self.block_size)), conversation)

    def _prompt_ids(self, path: str, data: dict[str, Any]) -> list[int] | None:
        if path in TGI_PATHS:
            inputs = data.get("inputs")
            parameters = data.get("parameters") or {}
            truncate = parameters.get("truncate") if isinstance(parameters, dict) else None
            if not isinstance(inputs, str):
                return None
            return self._truncated(self.tokenizer.encode(inputs[:MAX_ROUTED_CHARS]), truncate)
        if path == COMPLETION_PATH:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: routed by the first
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt[:MAX_ROUTED_CHARS])
            if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                return list(prompt)
            return None
        return self._chat_ids(data)

    def _chat_ids(self, data: dict[str, Any]) -> list[int]:
        """A chat body's prompt ids, rendered as the replica renders it."""
        from router.api.openai_schemas import ChatCompletionRequest
        from router.api.openai_tools import chat_messages, tool_plan

        body = ChatCompletionRequest.model_validate(data)
        messages, tools = chat_messages(
            body.messages, tool_plan(body, self.tokenizer), self.tokenizer
        )
        prompt = render_chat(self.tokenizer, messages, tools=tools)
        return encode_chat_prompt(self.tokenizer, prompt[:MAX_ROUTED_CHARS])

    @staticmethod
    def _truncated(ids: list[int], truncate: Any) -> list[int]:
        if isinstance(truncate, int) and 0 < truncate < len(ids):
            return ids[-truncate:]
        return ids


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
