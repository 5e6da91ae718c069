"""Requests that are not valid protobuf end with INVALID_ARGUMENT.

grpcio parses a request with the handler's ``request_deserializer`` before the handler
runs; a parse failure (truncated or garbled bytes, a string field that is not UTF-8)
would end the call with UNKNOWN and a Python exception name. The interceptor here
swaps in a deserializer that returns a :class:`MalformedRequest` instead of raising,
and a behaviour that answers it with INVALID_ARGUMENT naming the message type; valid
requests reach the servicer unchanged. Only unary-request methods (all of the public
API's) are wrapped.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class MalformedRequest:
    """Bytes that did not parse as the method's request message."""

    reason: str


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as error:
            return MalformedRequest(str(error) or "does not parse")
    return parse


def _message(request: MalformedRequest, method: str) -> str:
    return (f"request: not a valid protobuf message for {method} ({request.reason}); "
            "send the message the service's .proto defines")


def _checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that answers
    a :class:`MalformedRequest` with INVALID_ARGUMENT."""
    if handler.response_streaming and inspect.isasyncgenfunction(handler.unary_stream):
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request, method))
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)
    # A unary answer, or a stream written with context.write by a coroutine.
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
    build = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
             else grpc.unary_unary_rpc_method_handler)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request, method))
        return await inner(request, context)

    return build(unary, request_deserializer=_tolerant(handler.request_deserializer),
                 response_serializer=handler.response_serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answer requests that do not parse with INVALID_ARGUMENT (see the module)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_streaming
                or handler.request_deserializer is None):
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        return _checked(handler, method)
