"""TGI-compatible routes: ``POST /generate``, ``/generate_stream``, ``/`` and ``/tokenize``.

Shapes follow Hugging Face Text Generation Inference (its OpenAPI document and the
``text-generation`` Python client): ``/generate`` returns ``{"generated_text",
"details"}``; ``/generate_stream`` sends one server-sent event per token, the last
with ``generated_text`` and ``details``; ``POST /`` is ``/generate`` wrapped in a list
(or the stream when ``"stream": true``), which is what the ``text-generation`` client
calls. ``generated_text`` ends with the stop sequence that ended it (TGI semantics).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request, Response

from router.api.generation import (
    Completion,
    GenerationFailed,
    StartedStream,
    client_gone,
    run_all,
    start_stream,
)
from router.api.schemas import (
    BestOfSequence,
    Details,
    GenerateRequest,
    GenerateResponse,
    PrefillToken,
    StreamDetails,
    StreamResponse,
    Token,
    TokenInfo,
    TokenizeRequest,
)
from router.api.sse import SSEResponse, sse_events
from router.api.state import ServerState, State
from router.request import GenerationRequest, TokenEvent
from router.tokenizer import Tokenizer
from router.validation import RequestValidationError, public_seed


def _token_list_json(
    text: str, ids: list[int], offsets: list[tuple[int, int]], fallback: Callable[[int], str]
) -> bytes:
    """``/tokenize``'s answer, ``[TokenInfo, ...]`` as JSON, written token by token.

    NOTE: written as strings rather than through TokenInfo models and one serializer
    call: for 300k tokens that call holds the GIL (and so stops the event loop) for
    0.5 s, and 300k live models make the garbage collector stop every thread for
    longer still. Strings are not tracked by the collector.
    """
    parts = [
        f'{{"id":{token_id},"text":{json.dumps(text[start:stop] or fallback(token_id))},'
        f'"start":{start},"stop":{stop}}}'
        for token_id, (start, stop) in zip(ids, offsets, strict=True)
    ]
    return ("[" + ",".join(parts) + "]").encode()


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """Text of one token decoded alone (special tokens kept), as TGI reports it."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_tokens(tokenizer: Tokenizer, event: TokenEvent) -> list[Token]:
    """The alternatives of one generated token, most likely first."""
    return [
        Token(id=top.token_id, text=token_text(tokenizer, top.token_id), logprob=top.logprob,
              special=tokenizer.is_special(top.token_id))
        for top in event.top_tokens
    ]


def prefill_tokens(tokenizer: Tokenizer, completion: Completion) -> list[PrefillToken]:
    """One entry per prompt token; the first has no logprob (CASES A1)."""
    ids = completion.request.input_ids
    logprobs: list[float | None] = [None, *completion.prompt_logprobs]
    logprobs += [None] * (len(ids) - len(logprobs))
    return [
        PrefillToken(id=token_id, text=token_text(tokenizer, token_id), logprob=logprob)
        for token_id, logprob in zip(ids, logprobs, strict=False)
    ]


def _sequence_fields(
    tokenizer: Tokenizer, completion: Completion, prefix: str, with_prefill: bool
) -> dict[str, object]:
    assert completion.finish is not None, "a generation ended without a finish"
    return {
        "generated_text": prefix + completion.text,
        "finish_reason": completion.finish.reason.value,
        "generated_tokens": completion.num_generated,
        "seed": completion.seed,
        "prefill": prefill_tokens(tokenizer, completion) if with_prefill else [],
        "tokens": [
            Token(id=e.id, text=e.own_text, logprob=e.logprob, special=e.special)
            for e in completion.tokens
        ],
        "top_tokens": (
            [top_tokens(tokenizer, e) for e in completion.tokens]
            if completion.request.top_n_tokens else []
        ),
    }


router = APIRouter(tags=["TGI"])


async def _validate(state: ServerState, body: GenerateRequest) -> GenerationRequest:
    # Tokenizing runs off the event loop: a long prompt must not stop the streams.
    return await state.offload.run(state.validator.validate, body.inputs, body.parameters)


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
async def generate(body: GenerateRequest, http_request: Request, state: State) -> GenerateResponse:
    """Generate text (TGI ``POST /generate``)."""
    request = await _validate(state, body)
    best_of = body.parameters.best_of or 1
    details = body.parameters.details or body.parameters.decoder_input_details
    completions = await run_all(state.engine, state.validator.fan_out(request, best_of),
                                client_gone(http_request), token_texts=details)
    # best_of: the sequence with the highest total logprob, as TGI does.
    completions.sort(key=lambda c: c.logprob_sum, reverse=True)
    return _response(state.engine.tokenizer, body, completions, best_of)


def _response(tokenizer: Tokenizer, body: GenerateRequest, completions: list[Completion],
              best_of: int) -> GenerateResponse:
    """``/generate``'s answer: the best sequence, with the details asked for."""
    params = body.parameters
    prefix = body.inputs if params.return_full_text else ""
    if not (params.details or params.decoder_input_details):
        return GenerateResponse(generated_text=prefix + completions[0].text)
    best = _sequence_fields(tokenizer, completions[0], prefix, params.decoder_input_details)
    others = [
        BestOfSequence.model_validate(
            _sequence_fields(tokenizer, c, prefix, params.decoder_input_details)
        )
        for c in completions[1:]
    ]
    fields = {k: v for k, v in best.items() if k != "generated_text"}
    details = Details.model_validate(
        {**fields, "best_of_sequences": others if best_of > 1 else None}
    )
    return GenerateResponse(generated_text=str(best["generated_text"]), details=details)


@router.post("/generate_stream", response_class=SSEResponse)
async def generate_stream(
    body: GenerateRequest, http_request: Request, state: State
) -> SSEResponse:
    """Generate text as server-sent events (TGI ``POST /generate_stream``)."""
    if (body.parameters.best_of or 1) > 1:
        raise RequestValidationError("best_of", "best_of > 1 is not supported when streaming")
    request = await _validate(state, body)
    # The first token (or a 429) before the response starts; a client that leaves
    # while its request is queued cancels it.
    started = await start_stream(state.engine, [request], client_gone(http_request))
    return SSEResponse(_stream(state.engine.tokenizer, body, request, started))


async def _stream(
    tokenizer: Tokenizer, body: GenerateRequest, request: GenerationRequest,
    started: StartedStream,
) -> AsyncIterator[str | bytes]:
    prefix = body.inputs if body.parameters.return_full_text else ""
    # each token's text, for the last event's generated_text: strings, which the garbage
    # collector does not track (the events themselves are not kept)
    texts: list[str] = []

    def message(event: TokenEvent) -> str:
        texts.append(event.text)
        response = StreamResponse(
            index=len(texts),
            token=Token(id=event.id, text=event.text, logprob=event.logprob,
                        special=event.special),
            top_tokens=top_tokens(tokenizer, event),
        )
        if event.finish is not None:
            response.generated_text = prefix + "".join(texts)
            response.details = StreamDetails(
                finish_reason=event.finish.reason.value,
                generated_tokens=event.finish.generated_tokens,
                seed=public_seed(request),
            )
        return response.model_dump_json()

    try:
        async for batch in started.batches():  # one write for each batch
            yield sse_events(message(event) for _, event in batch)
    except GenerationFailed as error:
        yield json.dumps({"error": str(error), "error_type": "generation"})
    finally:
        await started.stream.aclose()


@router.post("/", response_model=None)
async def compat_generate(
    body: GenerateRequest, http_request: Request, state: State
) -> list[GenerateResponse] | SSEResponse:
    """TGI's ``POST /``: ``[/generate response]``, or the stream with ``stream: true``."""
    if body.stream:
        return await generate_stream(body, http_request, state)
    return [await generate(body, http_request, state)]


@router.post("/tokenize", response_model=list[TokenInfo])
async def tokenize(body: TokenizeRequest, state: State) -> Response:
    """Tokenize ``inputs``: ids, texts and character offsets (TGI ``POST /tokenize``)."""
    tokenizer = state.engine.tokenizer

    def answer() -> bytes:
        encoding = state.validator.tokenize(body.inputs, body.add_special_tokens)
        return _token_list_json(
            body.inputs, encoding.ids, encoding.offsets,
            lambda token_id: token_text(tokenizer, token_id),
        )

    # Tokenizing and writing the answer (one entry per token) run off the event loop.
    return Response(await state.offload.run(answer), media_type="application/json")
