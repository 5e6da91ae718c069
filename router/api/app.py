"""The HTTP server: TGI-compatible and OpenAI-compatible routes on FastAPI.

Routes: TGI ``POST /generate``, ``/generate_stream``, ``/``, ``/tokenize`` (router/api/tgi.py);
OpenAI ``POST /v1/completions``, ``/v1/chat/completions``, ``GET /v1/models``
(router/api/openai.py); ``GET /health``, ``GET /info``, ``GET /metrics`` (Prometheus);
the OpenAPI document at ``/openapi.json`` and its viewer at ``/docs``.

Errors: on TGI routes a bad request is 422 ``{"error", "error_type": "validation"}``
naming the field; on ``/v1/*`` it is 400 ``{"error": {"message", "type", "param",
"code"}}`` (OpenAI's shape), and an unknown ``model`` 404. A full queue is 429 with
``Retry-After``, a failure after acceptance 500 (or an error event when streaming),
in plain words (the detail goes to the log). Every refused request counts in
``shardserve_requests_total{outcome="rejected"}``. No input reaches a 5xx: anything
unexpected is logged and answered 500 with a JSON body, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError as SchemaValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api import openai as openai_api
from router.api import tgi
from router.api.auth import OPEN_PATHS, ApiKeyAuth
from router.api.errors import error_body
from router.api.generation import ClientDisconnected, GenerationFailed, GrammarFailed
from router.api.limits import BodySizeLimit
from router.api.openai_params import ModelNotFoundError
from router.api.schemas import Info
from router.api.state import ServerState, State, server_state
from router.chat_template import ChatTemplateError
from router.engine.api import QueueFullError, ShuttingDownError
from router.validation import RequestValidationError

__all__ = ["ServerState", "create_app"]


# Seconds a client refused with 429 is told to wait (Retry-After): about the time a
# running request needs to free its place.
RETRY_AFTER_S = 1


def _error(
    request: Request, status: int, message: str, error_type: str, param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """An error body in the shape of the route's API (TGI or OpenAI,
    :func:`router.api.errors.error_body`); a 429 carries ``Retry-After``."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    status, content = error_body(request.url.path, status, message, error_type, param, code)
    return JSONResponse(status_code=status, content=content, headers=headers)


# pydantic's tags of a union's plain-type branches (``prompt.str`` for ``str | list[int]``)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes"})


def _field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field path: ``tools[0].function.name``. The body
    prefix and union-branch tags (``literal['none','auto']``, ``NamedToolChoice``,
    ``function-after[...]``, ``str``) are dropped: they name schema internals, not
    fields."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif (part != "body" and part.isidentifier() and not part[:1].isupper()
              and part not in _TYPE_TAGS):
            path += f".{part}" if path else part
    return path or "body"


def _describe_schema_errors(errors: list[Any]) -> tuple[str, str | None]:
    """Message naming each offending field (the errors of one field's union branches
    joined), and the first field."""
    by_field: dict[str, list[str]] = {}
    for error in errors:
        field = "body" if error.get("type") == "json_invalid" else _field_path(
            error.get("loc", ()))
        message = error.get("msg", "invalid")
        if message not in by_field.setdefault(field, []):
            by_field[field].append(message)
    parts = [f"{field}: {'; or: '.join(messages)}" for field, messages in by_field.items()]
    return "; ".join(parts), next(iter(by_field), None)


class CancelledAsError:
    """Answer 500 with a JSON body when a ``CancelledError`` escapes a route although
    the request itself is not being cancelled (an awaited call was cancelled under it,
    for example a shard RPC whose channel a restart closed). Other exceptions reach the
    app's ``Exception`` handler; a CancelledError would reach Starlette's last-resort
    handler, which answers in plain text."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started or (task is not None and task.cancelling()):
                raise
            request = Request(scope)
            logger.error("a call was cancelled under {}", request.url.path)
            response = _error(request, 500, "internal error: a call was cancelled", "internal")
            await response(scope, receive, send)


def _count_rejected(state: ServerState) -> None:
    """Count a request refused before it reached the engine."""
    state.engine.count_rejected()


async def _schema_error(request: Request, exc: SchemaValidationError) -> JSONResponse:
    _count_rejected(server_state(request))
    message, field = _describe_schema_errors(list(exc.errors()))
    content_type = request.headers.get("content-type", "")
    if field == "body" and "json" not in content_type:
        # FastAPI reads a body of another media type as raw bytes, "not a dictionary"
        message = (f"body: must be a JSON object sent with Content-Type: application/json "
                   f"(got {content_type or 'no Content-Type'})")
    return _error(request, 422, message, "validation", field)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _count_rejected(server_state(request))
    return _error(request, 422, str(exc), "validation", exc.field)


async def _template_error(request: Request, exc: ChatTemplateError) -> JSONResponse:
    _count_rejected(server_state(request))
    return _error(request, 422, f"messages: {exc}", "validation", "messages")


async def _no_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
    _count_rejected(server_state(request))
    return _error(request, 404, str(exc), "not_found", "model", code="model_not_found")


async def _shutting_down(request: Request, exc: ShuttingDownError) -> JSONResponse:
    return _error(request, 503, str(exc), "unavailable")


async def _overloaded(request: Request, exc: QueueFullError) -> JSONResponse:
    return _error(request, 429, str(exc), "overloaded")


async def _failed(request: Request, exc: GenerationFailed) -> JSONResponse:
    return _error(request, 500, str(exc), "generation")


async def _grammar_failed(request: Request, exc: GrammarFailed) -> JSONResponse:
    # the request's own grammar is at fault: invalid input, found during generation
    return _error(request, 422, str(exc), "validation")


async def _gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
    # Nobody reads this; 499 is the conventional "client closed request" status.
    return _error(request, 499, str(exc), "cancelled")


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code in (404, 405):  # no such route or method: no field is at fault
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed"
        return _error(request, exc.status_code, str(exc.detail), kind)
    # E.g. a body that is not UTF-8 or nests too deeply to parse: name the body.
    if exc.status_code in (400, 413):
        _count_rejected(server_state(request))
    message = f"body: {exc.detail}" if exc.status_code in (400, 413) else exc.detail
    # a body that does not parse is invalid input like any other: 422 (400 on OpenAI's
    # routes, as every invalid request there)
    status = 422 if exc.status_code == 400 else exc.status_code
    return _error(request, status, str(message), "validation", "body")


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    logger.opt(exception=exc).error("unhandled error on {}", request.url.path)
    return _error(request, 500, f"internal error: {type(exc).__name__}", "internal")


# Exception type -> its answer. ShuttingDownError before QueueFullError: it is one.
_ERROR_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
    SchemaValidationError: _schema_error,
    RequestValidationError: _validation_error,
    ChatTemplateError: _template_error,
    ModelNotFoundError: _no_model,
    ShuttingDownError: _shutting_down,
    QueueFullError: _overloaded,
    GrammarFailed: _grammar_failed,
    GenerationFailed: _failed,
    ClientDisconnected: _gone,
    StarletteHTTPException: _http_error,
    Exception: _internal,
}

service = APIRouter(tags=["TGI"])


@service.get("/health")
async def health(request: Request, state: State) -> JSONResponse:
    """200 when the shard group serves (every rank answers the supervisor's liveness
    pings), the last step succeeded and the server is not shutting down, else 503
    naming why; the gRPC health service answers the same. Answered at once from the
    known state (:mod:`router.health`), never by calling a shard."""
    problem = await state.engine.health_problem()
    if problem is not None:
        return _error(request, 503, problem, "unhealthy")
    return JSONResponse({"status": "ok"})


@service.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: State) -> PlainTextResponse:
    """Prometheus text exposition (names listed in the README); open unless
    ``--metrics-require-api-key on``."""
    return PlainTextResponse(await state.engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)


@service.get("/info", response_model=Info)
async def info(state: State) -> Info:
    """Model, shards, KV cache and request limits."""
    budgets = state.engine.config
    status = await state.engine.snapshot()
    limits = state.validator.limits
    return Info(
        model_id=state.model_id,
        model_dtype=state.dtype,
        model_device_type=state.device_type,
        num_shard=state.num_shard,
        attention_backend=state.attention_backend,
        quantization=state.quantization,
        kv_cache_dtype=state.kv_cache_dtype or state.dtype,
        quantization_details=state.quantization_details,
        speculative_decoding=state.speculative_decoding,
        speculative_proposed_tokens=status.speculative_proposed,
        speculative_accepted_tokens=status.speculative_accepted,
        block_size=status.block_size,
        kv_blocks_total=status.kv_blocks_total,
        kv_blocks_free=status.kv_blocks_free,
        kv_blocks_used=status.kv_blocks_used,
        prefix_cache_hit_tokens=status.prefix_cache_hit_tokens,
        max_input_tokens=budgets.max_input_tokens,
        max_total_tokens=budgets.max_total_tokens,
        max_batch_prefill_tokens=budgets.max_batch_prefill_tokens,
        max_concurrent_requests=budgets.max_concurrent_requests,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_top_n_tokens=limits.max_top_n_tokens,
        version=state.version,
    )


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application serving ``state``."""
    app = FastAPI(
        title="shardserve",
        version=state.version,
        description="LLM text generation: TGI-compatible and OpenAI-compatible APIs.",
    )
    app.state.server = state
    for exc_type, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(BodySizeLimit, max_bytes=state.max_request_bytes,
                       on_reject=lambda: _count_rejected(state))
    app.add_middleware(CancelledAsError)
    if state.api_key:
        open_paths = OPEN_PATHS - {"/metrics"} if state.metrics_require_api_key else OPEN_PATHS
        # outermost: checked first
        app.add_middleware(ApiKeyAuth, api_key=state.api_key, open_paths=open_paths)
    app.include_router(tgi.router)
    app.include_router(openai_api.router)
    app.include_router(service)
    return app
