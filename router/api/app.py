"""The HTTP server: TGI-compatible routes on FastAPI.

Routes: ``POST /generate``, ``POST /generate_stream`` (server-sent events), ``GET /health``,
``GET /info``. Validation errors are 422 with ``{"error", "error_type": "validation"}``
naming the field; a full queue is 429; a failure after acceptance is 500 (or an SSE
``error`` event when streaming).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as SchemaValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse

from router.api.schemas import (
    Details,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    Info,
    StreamDetails,
    StreamResponse,
    Token,
)
from router.engine import Engine, QueueFullError
from router.request import ErrorEvent, Finish, GenerationRequest, TokenEvent
from router.validation import RequestValidationError, Validator


@dataclass
class ServerState:
    """What the routes need: the engine, the validator and static model facts."""

    engine: Engine
    validator: Validator
    model_id: str
    dtype: str
    device_type: str
    num_shard: int
    attention_backend: str
    version: str


class GenerationFailed(RuntimeError):
    """A request failed after it was accepted."""


def _error(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse(
        status_code=status, content=ErrorResponse(error=message, error_type=error_type).model_dump()
    )


def _describe_schema_errors(errors: list[Any]) -> str:
    parts = []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        field = ".".join(loc) if loc else "body"
        if error.get("type") == "json_invalid":
            field = "body"
        parts.append(f"{field}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def _token(event: TokenEvent) -> Token:
    return Token(id=event.id, text=event.text, logprob=event.logprob, special=event.special)


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application serving ``state``."""
    app = FastAPI(title="shardserve", version=state.version)

    @app.exception_handler(SchemaValidationError)
    async def _schema_error(_: Request, exc: SchemaValidationError) -> JSONResponse:
        return _error(422, _describe_schema_errors(list(exc.errors())), "validation")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, str(exc), "validation")

    @app.exception_handler(QueueFullError)
    async def _overloaded(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(429, str(exc), "overloaded")

    @app.exception_handler(GenerationFailed)
    async def _failed(_: Request, exc: GenerationFailed) -> JSONResponse:
        return _error(500, str(exc), "generation")

    def validate(body: GenerateRequest) -> GenerationRequest:
        return state.validator.validate(body.inputs, body.parameters)

    @app.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
    async def generate(body: GenerateRequest) -> GenerateResponse:
        request = validate(body)
        tokens: list[TokenEvent] = []
        async for event in state.engine.generate(request):
            if isinstance(event, ErrorEvent):
                raise GenerationFailed(event.message)
            tokens.append(event)
        finish: Finish | None = tokens[-1].finish if tokens else None
        assert finish is not None, "a generation ended without a finish"
        text = "".join(token.text for token in tokens)
        if body.parameters.return_full_text:
            text = body.inputs + text
        details = None
        if body.parameters.details:
            details = Details(
                finish_reason=finish.reason.value,
                generated_tokens=finish.generated_tokens,
                seed=request.sampling.seed if request.sampling.do_sample else None,
                tokens=[_token(token) for token in tokens],
            )
        return GenerateResponse(generated_text=text, details=details)

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest) -> EventSourceResponse:
        request = validate(body)
        # Submit now so a full queue is a 429 before the stream starts.
        events = state.engine.generate(request)
        first = await anext(events)
        return EventSourceResponse(_stream(body, request, first, events))

    async def _stream(
        body: GenerateRequest, request: GenerationRequest, first: Any,
        events: AsyncGenerator[Any, None],
    ) -> AsyncIterator[str]:
        prefix = body.inputs if body.parameters.return_full_text else ""
        texts: list[str] = []

        async def all_events() -> AsyncIterator[Any]:
            yield first
            async for event in events:
                yield event

        try:
            index = 0
            async for event in all_events():
                if isinstance(event, ErrorEvent):
                    yield json.dumps({"error": event.message, "error_type": "generation"})
                    return
                index += 1
                texts.append(event.text)
                response = StreamResponse(index=index, token=_token(event))
                if event.finish is not None:
                    response.generated_text = prefix + "".join(texts)
                    response.details = StreamDetails(
                        finish_reason=event.finish.reason.value,
                        generated_tokens=event.finish.generated_tokens,
                        seed=request.sampling.seed if request.sampling.do_sample else None,
                    )
                yield response.model_dump_json()
        finally:
            await events.aclose()

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await state.engine.client.health()
        except Exception as error:
            return _error(503, f"shards unhealthy: {error}", "unhealthy")
        if not state.engine.healthy:
            return _error(503, "the last generation step failed", "unhealthy")
        if state.engine.draining:
            return _error(503, "shutting down", "unhealthy")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text exposition (names listed in the README)."""
        return PlainTextResponse(state.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/info", response_model=Info)
    async def info() -> Info:
        engine = state.engine
        budgets = engine.config
        limits = state.validator.limits
        return Info(
            model_id=state.model_id,
            model_dtype=state.dtype,
            model_device_type=state.device_type,
            num_shard=state.num_shard,
            attention_backend=state.attention_backend,
            block_size=engine.block_manager.block_size,
            kv_blocks_total=engine.block_manager.num_blocks,
            kv_blocks_free=engine.kv_blocks_free,
            max_input_tokens=budgets.max_input_tokens,
            max_total_tokens=budgets.max_total_tokens,
            max_batch_prefill_tokens=budgets.max_batch_prefill_tokens,
            max_concurrent_requests=budgets.max_concurrent_requests,
            max_best_of=limits.max_best_of,
            max_stop_sequences=limits.max_stop_sequences,
            max_top_n_tokens=limits.max_top_n_tokens,
            version=state.version,
        )

    return app
