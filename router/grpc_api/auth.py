"""``--api-key`` on the public gRPC API: calls need the metadata
``authorization: Bearer <key>``; the standard health service stays open for probes.
A refused call ends with UNAUTHENTICATED before its handler runs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

from router.api.auth import bearer_matches

_OPEN_PREFIX = f"/{health.SERVICE_NAME}/"
_MESSAGE = "missing or wrong API key: send the metadata authorization: Bearer <key>"


async def _refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
    yield  # pragma: no cover  (abort raises; this makes the function a generator)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    build = kinds[(handler.request_streaming, handler.response_streaming)]
    behaviour = _refuse_stream if handler.response_streaming else _refuse_unary
    return build(behaviour, request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Let through calls whose metadata carries ``authorization: Bearer <api_key>``,
    and every call of ``grpc.health.v1.Health``."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(_OPEN_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        if bearer_matches(metadata.get("authorization"), self.api_key):
            return handler
        return _refusing(handler)
