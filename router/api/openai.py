"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Source: the OpenAI API reference. Choices are independent requests (``n`` of them, choice
i seeded with ``seed + i``); the stop text is not part of a choice (finish_reason
``stop``, as for EOS); streams are server-sent events ending with ``data: [DONE]``, with
a last ``usage`` chunk when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from loguru import logger

from router.api.generation import (
    Completion,
    GenerationFailed,
    client_gone,
    run_all,
    start_stream,
    text_without_stop,
)
from router.api.openai_logprobs import (
    EchoedPrompt,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt,
)
from router.api.openai_params import (
    COMPLETION_NAMES,
    DEFAULT_CHAT_MAX_TOKENS,
    check_n,
    check_request,
    check_top_n,
    finish_reason,
    openai_field_names,
    sampling_parameters,
    usage_of,
)
from router.api.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)
from router.api.openai_tools import (
    RESPONSE_SCHEMA_FIELD,
    StreamedChoice,
    ToolPlan,
    blame_tool,
    call_deltas,
    chat_messages,
    check_messages,
    response_grammar,
    tool_calls_of,
    tool_plan,
)
from router.api.sse import SSEResponse, sse_events
from router.api.state import ServerState, State
from router.chat_template import encode_chat_prompt, render_chat
from router.parameters import GenerateParameters
from router.request import GenerationRequest, TokenEvent
from router.validation import (
    RequestValidationError,
    Validator,
    check_text,
)

router = APIRouter(prefix="/v1", tags=["OpenAI"])


@router.get("/models", response_model=ModelList)
async def models(state: State) -> ModelList:
    """The model, once per served name (OpenAI ``GET /v1/models``)."""
    max_len = state.engine.config.max_total_tokens
    return ModelList(data=[ModelCard(id=name, created=0, max_model_len=max_len)
                           for name in state.model_names])


@router.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, http_request: Request, state: State) -> Any:
    """Text completion (OpenAI ``POST /v1/completions``)."""
    check_request(body, state)
    with openai_field_names(COMPLETION_NAMES):
        if _token_ids_only(body):  # checked in microseconds: no thread hand-off
            prompts, requests, width = _completion_requests(state.validator, body)
        else:  # tokenizing runs off the event loop: a long prompt must not stop the streams
            prompts, requests, width = await state.offload.run(
                _completion_requests, state.validator, body
            )
    tokenizer = state.engine.tokenizer
    echoes: list[EchoedPrompt | None] = [
        echoed_prompt(tokenizer, p, len(r.input_ids)) if body.echo else None
        for p, r in zip(prompts, requests[::width], strict=True)
    ]
    answer = _CompletionAnswer(state, body, requests, echoes, width)
    if body.stream:
        return await _sse(state, requests, [], answer.on_event, answer.usage_chunk, body,
                          http_request)
    # each token's text is read only for logprobs' text offsets
    done = await run_all(state.engine, requests, client_gone(http_request),
                         token_texts=body.logprobs is not None)
    return answer.whole(done)


class _CompletionAnswer:
    """A ``/v1/completions`` answer: whole, or as stream chunks (see :func:`_sse`).

    ``width`` sequences are generated per prompt (best_of, else n); ``echoes`` holds
    each prompt's echoed text and tokens when ``echo`` is set.
    """

    def __init__(self, state: ServerState, body: CompletionRequest,
                 requests: list[GenerationRequest], echoes: list[EchoedPrompt | None],
                 width: int) -> None:
        self.state, self.body, self.echoes, self.width = state, body, echoes, width
        self.tokenizer = state.engine.tokenizer
        self.prompt_tokens = sum(len(r.input_ids) for r in requests[::width])
        self.ident, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.streamed = [Completion(r) for r in requests]
        self.offsets = [len(e.text) if e is not None else 0 for e in echoes
                        for _ in range(width)]

    def choice(self, index: int, completion: Completion, events: list[TokenEvent], start: int,
               text: str) -> CompletionChoice:
        """Choice ``index`` with ``events``, the first starting at character ``start``
        of the choice's text; the echoed prompt's tokens lead its logprobs when
        ``events`` are the choice's first."""
        echo = self.echoes[index // self.body.n]  # streaming needs best_of == n
        logprobs = None
        if self.body.logprobs is not None:
            prompt = None
            if echo is not None and events and events[0] is completion.tokens[0]:
                prompt = (echo, completion.request.input_ids, completion.prompt_logprobs)
            logprobs = completion_logprobs(self.tokenizer, events, start, prompt)
        finish = events[-1].finish if events else completion.finish
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason(finish),
                                logprobs=logprobs)

    def on_event(self, index: int, event: TokenEvent) -> list[str]:
        """The stream chunk of one token of sequence ``index``."""
        completion = self.streamed[index]
        first = not completion.tokens
        if first:
            # NOTE: only the first event is kept (its prompt logprobs lead the echo): a
            # stream's events held to its end would all be scanned by every full
            # collection of the garbage collector, a pause of the whole router
            completion.tokens.append(event)
        echo = self.echoes[index // self.width]
        text = text_without_stop(event.text, event.finish)
        if first and echo is not None:
            text = echo.text + text
        start = self.offsets[index]
        self.offsets[index] += len(event.own_text)
        return [CompletionChunk(
            id=self.ident, created=self.created, model=self.state.model_id,
            choices=[self.choice(index, completion, [event], start, text)],
        ).model_dump_json()]

    def usage_chunk(self, done: list[Completion]) -> str:
        return CompletionChunk(
            id=self.ident, created=self.created, model=self.state.model_id, choices=[],
            usage=usage_of(self.prompt_tokens, done),
        ).model_dump_json()

    def whole(self, done: list[Completion]) -> CompletionResponse:
        """The answer sent whole: per prompt, the ``n`` best of its ``width`` sequences."""
        body, width = self.body, self.width
        result = []
        for p, echo in enumerate(self.echoes):
            group = done[p * width : (p + 1) * width]
            if width > body.n:
                group = sorted(group, key=lambda c: c.logprob_sum, reverse=True)[: body.n]
            for j, c in enumerate(group):
                prefix = echo.text if echo is not None else ""
                out = prefix + text_without_stop(c.text, c.finish)
                # the events only when logprobs are asked for: a whole answer's are
                # built on first read (Completion.tokens)
                events = c.tokens if body.logprobs is not None else []
                result.append(self.choice(p * body.n + j, c, events, len(prefix), out))
        return CompletionResponse(id=self.ident, created=self.created,
                                  model=self.state.model_id, choices=result,
                                  usage=usage_of(self.prompt_tokens, done))


def _token_ids_only(body: CompletionRequest) -> bool:
    """Whether preparing ``body`` needs no tokenizer and no grammar: its prompts are token
    ids (checked at ~0.08 µs per id; sending them to a worker thread cost more than the
    check in a burst of requests) and it asks for no ``response_format``."""
    prompt = body.prompt
    return (body.response_format is None and isinstance(prompt, list) and bool(prompt)
            and not isinstance(prompt[0], str))


def _completion_requests(
    validator: Validator, body: CompletionRequest,
) -> tuple[list[str | list[int]], list[GenerationRequest], int]:
    """(prompts, requests: ``width`` per prompt, width = best_of or n)."""
    width = check_n(validator, body, body.best_of)
    top_n = check_top_n(validator, body.logprobs or 0, "logprobs")
    echo_logprobs = body.echo and body.logprobs is not None
    params = sampling_parameters(body, body.max_tokens or 16, top_n, prompt_logprobs=echo_logprobs,
                         grammar=response_grammar(body.response_format))
    prompts: list[Any]
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts = [body.prompt]
    else:
        prompts = list(body.prompt)
    if not prompts:
        raise RequestValidationError("prompt", "must not be empty")
    if len(prompts) * width > validator.limits.max_best_of * 4:
        raise RequestValidationError(
            "prompt", f"{len(prompts)} prompts x {width} choices is over the "
            f"{validator.limits.max_best_of * 4} sequences one request may ask for "
            "(4 x --max-best-of)")
    validator.check_sequences(len(prompts) * width, "prompt")
    requests: list[GenerationRequest] = []
    for prompt in prompts:
        request = validator.validate(prompt, params, field="prompt")
        requests += validator.fan_out(request, width)
    return prompts, requests, width


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(
    body: ChatCompletionRequest, http_request: Request, state: State
) -> Any:
    """Chat completion with the model's chat template (``POST /v1/chat/completions``)."""
    check_request(body, state)
    request, plan = await _chat_request(state, body)
    requests = state.validator.fan_out(request, body.n)
    answer = _ChatAnswer(state, body, plan, len(request.input_ids))
    if body.stream:
        opening = [answer.chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant",
                                                                      content=""))])
                   for i in range(body.n)]
        return await _sse(state, requests, opening, answer.on_event, answer.usage_chunk, body,
                          http_request)
    # chat logprobs name each token by its id's own text, not by its share of the text
    done = await run_all(state.engine, requests, client_gone(http_request), token_texts=False)
    return answer.whole(done)


async def _chat_request(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[GenerationRequest, ToolPlan]:
    """The validated request of a chat body (its messages rendered with the chat template
    and tokenized off the event loop) and its tool-call plan."""
    tokenizer, validator = state.engine.tokenizer, state.validator
    names = {"max_new_tokens": "max_completion_tokens"
             if body.max_completion_tokens is not None else "max_tokens",
             "top_n_tokens": "top_logprobs", "inputs": "messages"}
    with openai_field_names(names):
        if body.top_logprobs and not body.logprobs:
            raise RequestValidationError("top_logprobs", "needs logprobs: true")
        check_n(validator, body, None)
        top_n = check_top_n(validator, body.top_logprobs or 0, "top_logprobs")
        max_tokens = (body.max_completion_tokens or body.max_tokens
                      or DEFAULT_CHAT_MAX_TOKENS)
        check_messages(body.messages)
        plan = tool_plan(body, tokenizer)
        names["grammar.value"] = RESPONSE_SCHEMA_FIELD
        params = sampling_parameters(body, max_tokens, top_n,
                             grammar=plan.grammar or response_grammar(body.response_format))
        # Rendering and tokenizing run off the event loop: a long prompt must not
        # stop the streams.
        return await state.offload.run(_prepare_chat, state, body, plan, params), plan


def _prepare_chat(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan,
                  params: GenerateParameters) -> GenerationRequest:
    """The request of a chat body: its messages rendered with the chat template, then
    tokenized and validated (blocking). A refusal that the tools cause names them: a
    forced call's grammar that does not compile (see :func:`blame_tool`), or a prompt
    too long with the tools that passes without them.

    Raises:
        RequestValidationError: naming the field (/generate's names for the parameters).
    """
    tokenizer, validator = state.engine.tokenizer, state.validator

    def encode(with_tools: bool) -> list[int]:
        messages, tools = chat_messages(
            body.messages, plan if with_tools else ToolPlan("none", None, None, plan.fmt),
            tokenizer)
        prompt = render_chat(tokenizer, messages, tools=tools)
        check_text("messages", prompt)
        validator.check_chars(prompt, "messages", params.truncate)
        return encode_chat_prompt(tokenizer, prompt)

    try:
        return validator.validate(encode(with_tools=True), params, field="messages")
    except RequestValidationError as error:
        if error.field == "grammar.value" and plan.grammar:
            raise blame_tool(error, plan, body, validator) from None
        if error.field != "messages" or plan.tools is None:
            raise
        try:
            fits = len(encode(with_tools=False)) <= validator.budgets.max_input_tokens
        except RequestValidationError:
            fits = False
        if not fits:
            raise
        raise RequestValidationError(
            "tools", f"the prompt with the tools: {error.message}") from None


class _ChatAnswer:
    """A ``/v1/chat/completions`` answer: whole, or as stream chunks (see :func:`_sse`);
    tool calls parsed from the output by ``plan``."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, plan: ToolPlan,
                 prompt_tokens: int) -> None:
        self.state, self.body, self.plan = state, body, plan
        self.tokenizer = state.engine.tokenizer
        self.prompt_tokens = prompt_tokens
        self.ident, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.streamed = [StreamedChoice(plan) for _ in range(body.n)]

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(
            id=self.ident, created=self.created, model=self.state.model_id, choices=choices,
            usage=usage,
        ).model_dump_json()

    def on_event(self, index: int, event: TokenEvent) -> list[str]:
        """The stream chunks of one token of choice ``index`` (none while held back:
        it may begin a tool call)."""
        chunk, plan = self.chunk, self.plan
        logprobs = chat_logprobs(self.tokenizer, [event]) if self.body.logprobs else None
        content = self.streamed[index].feed(text_without_stop(event.text, event.finish))
        if event.finish is None:
            if not content and logprobs is None and plan.mode != "none":
                return []  # held back: it may be a tool call
            return [chunk([ChatChunkChoice(index=index, delta=Delta(content=content),
                                           logprobs=logprobs)])]
        tail, calls = self.streamed[index].finish()
        reason = "tool_calls" if calls else finish_reason(event.finish)
        if not calls:
            return [chunk([ChatChunkChoice(index=index, delta=Delta(content=content + tail),
                                           logprobs=logprobs, finish_reason=reason)])]
        lines = []
        if content + tail:
            lines.append(chunk([ChatChunkChoice(
                index=index, delta=Delta(content=content + tail), logprobs=logprobs)]))
            logprobs = None
        lines.append(chunk([ChatChunkChoice(
            index=index, delta=Delta(tool_calls=call_deltas(calls)), logprobs=logprobs)]))
        lines.append(chunk([ChatChunkChoice(index=index, delta=Delta(),
                                            finish_reason=reason)]))
        return lines

    def usage_chunk(self, done: list[Completion]) -> str:
        return self.chunk([], usage=usage_of(self.prompt_tokens, done))

    def whole(self, done: list[Completion]) -> ChatCompletionResponse:
        """The answer sent whole: one choice per sequence, tool calls parsed."""
        choices = []
        for i, c in enumerate(done):
            content, calls = tool_calls_of(text_without_stop(c.text, c.finish), self.plan)
            choices.append(ChatChoice(
                index=i,
                message=AssistantMessage(content=content, tool_calls=calls or None),
                logprobs=chat_logprobs(self.tokenizer, c.tokens) if self.body.logprobs
                else None,
                finish_reason="tool_calls" if calls else finish_reason(c.finish),
            ))
        return ChatCompletionResponse(id=self.ident, created=self.created,
                                      model=self.state.model_id, choices=choices,
                                      usage=usage_of(self.prompt_tokens, done))


async def _sse(
    state: ServerState, requests: list[GenerationRequest], opening: list[str],
    on_event: Callable[[int, TokenEvent], list[str]],
    usage_chunk: Callable[[list[Completion]], str], body: SamplingFields,
    http_request: Request,
) -> SSEResponse:
    """Stream ``requests`` as OpenAI chunks; ``[DONE]`` last. The first token (or a 429)
    comes before the response starts; a client that leaves before it cancels them."""
    started = await start_stream(state.engine, requests, client_gone(http_request))
    done = [Completion(r) for r in requests]

    async def lines() -> AsyncIterator[str | bytes]:
        try:
            for line in opening:
                yield line
            async for batch in started.batches():  # one write for each batch
                chunks: list[str] = []
                for index, event in batch:
                    # the usage chunk reads each finish's count; no event is kept
                    done[index].finish = event.finish or done[index].finish
                    chunks.extend(on_event(index, event))
                yield sse_events(chunks)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield usage_chunk(done)
            yield "[DONE]"
        except Exception as error:
            if isinstance(error, GenerationFailed):
                message = f"generation failed: {error}"  # plain words (see ShardError)
            else:
                logger.opt(exception=error).error("OpenAI stream failed")
                message = "generation failed: internal error; see the server log"
            yield json.dumps({"error": {"message": message, "type": "server_error",
                                        "param": None, "code": None}})
        finally:
            await started.stream.aclose()

    return SSEResponse(lines())
