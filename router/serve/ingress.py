"""The ingress of ``shardserve serve``: the deployment behind Ray Serve's HTTP and gRPC
proxies that forwards every call to one replica.

HTTP: every route but ``/metrics`` is forwarded as it came (method, path, headers,
body) and the replica's own app answers it (:mod:`router.serve.asgi_call`), so the
TGI and OpenAI routes, streams, errors, ``/health`` and ``/info`` are the one-replica
server's (``/info`` and ``/health`` are those of the replica the call reached).
``/metrics`` joins every live replica's series, each labelled ``replica``, with the
ingress's routing decisions (:mod:`router.serve.board`).

gRPC: the public ``TextGeneration`` methods and the standard health ``Check`` are
methods here, called by Ray Serve's gRPC proxy with the decoded request; each is sent
serialized to a replica, whose own servicer answers it, status codes included. The
health ``Watch`` is answered here from a replica's ``Check`` every second
(:mod:`router.serve.health_watch`). Server reflection is the proxy's own (Ray Serve's
``enable_reflection``), listing the services registered on it.

Before a generating call leaves, its prompt is tokenized and hashed into block digests
(:mod:`router.serve.hints`) for the request router. A replica that dies under a call
ends it with a clear error: 503 naming the lost replica (an error event when a stream
had begun), gRPC UNAVAILABLE; never a hang.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from loguru import logger
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.api.errors import error_body
from router.config import ServerConfig
from router.log import setup_logging
from router.pb import generate_pb2 as pb
from router.serve import grpc_services  # noqa: F401 (importable pickles of the messages)
from router.serve.affinity import (
    ROUTING_DECISIONS,
    ROUTING_EXPECTED_HIT_BLOCKS,
    ROUTING_PASSED_OVER,
    RouteHint,
)
from router.serve.asgi_call import HttpCall, HttpStart
from router.serve.board import merge_expositions
from router.serve.config import CONVERSATION_HEADER
from router.serve.health_watch import INGRESS_STOPPING, PROBE_TIMEOUT_S, StopSign, watch_statuses
from router.serve.hints import HintMaker
from router.serve.replica import GrpcStatus, get_board
from router.tokenizer import Tokenizer

TEXT_GENERATION = "/shardserve.generate.v1.TextGeneration/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
# Response headers the ingress's own server writes again.
_HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})


def lost_replica_message(error: BaseException) -> str:
    """What a client is told when the replica serving its call went away."""
    return (
        f"the replica serving this request stopped before it finished "
        f"({type(error).__name__}); the request was not completed, retry it"
    )


class Ingress:
    """A Ray Serve deployment class: the public surface over the replicas.

    Args:
        replicas: The handle of the replica deployment (routed by our request router).
        config: The server's flags (tokenizer folder, block size, API key).
        app_name: The Serve application's name (which board to read).
    """

    def __init__(self, replicas: Any, config: ServerConfig, app_name: str) -> None:
        from ray import serve

        setup_logging(json_output=config.shard.json_logs)
        self.replicas = replicas
        self.hints = HintMaker(
            Tokenizer.from_folder(config.shard.model_path), config.shard.block_size
        )
        self.app_name = app_name
        self.board = get_board(app_name)
        context = serve.get_replica_context()
        self.stop_sign = StopSign(app_name, context.deployment, context.replica_id.unique_id)

    def __serve_build_asgi_app__(self) -> Starlette:
        """The HTTP app Ray Serve's proxy calls (built once the class is constructed)."""
        return Starlette(
            routes=[
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/{path:path}", self.forward, methods=METHODS),
            ]
        )

    async def metrics(self, request: Request) -> Response:
        """Every live replica's metrics (label ``replica``) and this ingress's routing
        counters (decisions, passed-over holders, expected prefix hits per replica), as
        one Prometheus text exposition."""
        posts = await self.board.read.remote()
        lines = _counter(
            "shardserve_routing_decisions_total",
            "Calls routed, by why their replica was chosen (this ingress replica)",
            "reason",
            ROUTING_DECISIONS,
        )
        lines += _counter(
            "shardserve_routing_passed_over_total",
            "Calls not sent to the replica holding their longest cached prefix, by why "
            "(this ingress replica)",
            "reason",
            ROUTING_PASSED_OVER,
        )
        block_size = self.hints.block_size
        lines += _counter(
            "shardserve_routing_expected_hit_tokens_total",
            "Prompt tokens the routing index expected each replica's prefix cache to "
            "hold for the calls sent there (compare shardserve_prefix_cache_hit_tokens_total)",
            "replica",
            {
                replica: blocks * block_size
                for replica, blocks in ROUTING_EXPECTED_HIT_BLOCKS.items()
            },
        )
        extra = ("\n".join(lines) + "\n").encode()
        return Response(
            merge_expositions(posts, extra), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def forward(self, request: Request) -> Response:
        """Send the call to a replica and relay its answer as it comes."""
        body = await request.body()
        path = request.url.path
        headers = {name.lower(): value for name, value in request.headers.items()}
        client = (request.client.host, request.client.port) if request.client else None
        call = HttpCall(
            request.method,
            path,
            request.url.query.encode(),
            tuple(request.headers.raw),
            body,
            client,
        )
        hint = await asyncio.to_thread(self.hints.for_http, path, body, headers)
        stream = self.replicas.options(stream=True).http.remote(call, route=hint)
        try:
            start = await stream.__anext__()
        except Exception as error:
            logger.error("a call to {} lost its replica: {!r}", path, error)
            status, content = error_body(path, 503, lost_replica_message(error), "unavailable")
            return JSONResponse(content, status_code=status)
        assert isinstance(start, HttpStart), f"a response starts with HttpStart: {start!r}"
        streaming = any(
            name == b"content-type" and value.startswith(b"text/event-stream")
            for name, value in start.headers
        )
        response = StreamingResponse(_relay(stream, path, streaming), status_code=start.status)
        response.raw_headers = [(n, v) for n, v in start.headers if n not in _HOP_HEADERS]
        return response

    async def _grpc(
        self, method: str, request: Any, grpc_context: Any, hint: RouteHint | None
    ) -> AsyncIterator[bytes]:
        """The serialized answers of ``method`` from a replica; an error ends the call
        with the replica's status (UNAVAILABLE when the replica was lost)."""
        stream = self._call_replica(method, request, grpc_context, hint)
        try:
            async for part in stream:
                if isinstance(part, GrpcStatus):
                    grpc_context.set_code(grpc.StatusCode[_code_name(part.code)])
                    grpc_context.set_details(part.details)
                    raise RuntimeError(part.details)
                yield part
        except RuntimeError:
            raise
        except Exception as error:
            logger.error("a gRPC call to {} lost its replica: {!r}", method, error)
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details(lost_replica_message(error))
            raise RuntimeError(lost_replica_message(error)) from error

    def _call_replica(
        self, method: str, request: Any, grpc_context: Any, hint: RouteHint | None
    ) -> Any:
        """A replica's answers to ``method`` (serialized messages, then a
        :class:`GrpcStatus` if it failed), with the call's own metadata."""
        metadata = tuple(
            (k, v)
            for k, v in grpc_context.invocation_metadata()
            if not k.startswith(":") and k not in ("application", "request_id")
        )
        return self.replicas.options(stream=True).grpc.remote(
            method, request.SerializeToString(), metadata, route=hint
        )

    def _generate_hint(self, request: pb.GenerateRequest, grpc_context: Any) -> RouteHint:
        conversation = dict(grpc_context.invocation_metadata()).get(CONVERSATION_HEADER)
        truncate = request.parameters.truncate if request.parameters.HasField("truncate") else None
        return self.hints.for_grpc(request.inputs, truncate, conversation)

    async def _unary(
        self, method: str, request: Any, grpc_context: Any, hint: RouteHint | None, answer: Any
    ) -> Any:
        async for part in self._grpc(method, request, grpc_context, hint):
            return answer.FromString(part)
        raise AssertionError("a unary call answers once")

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        """Public gRPC ``Generate``."""
        hint = await asyncio.to_thread(self._generate_hint, request, grpc_context)
        return await self._unary(
            TEXT_GENERATION + "Generate", request, grpc_context, hint, pb.GenerateResponse
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Public gRPC ``GenerateStream``."""
        hint = await asyncio.to_thread(self._generate_hint, request, grpc_context)
        async for part in self._grpc(
            TEXT_GENERATION + "GenerateStream", request, grpc_context, hint
        ):
            yield pb.GenerateStreamResponse.FromString(part)

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: Any) -> pb.TokenizeResponse:
        """Public gRPC ``Tokenize``."""
        return await self._unary(
            TEXT_GENERATION + "Tokenize", request, grpc_context, None, pb.TokenizeResponse
        )

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, grpc_context: Any
    ) -> pb.ModelInfoResponse:
        """Public gRPC ``ModelInfo``."""
        return await self._unary(
            TEXT_GENERATION + "ModelInfo", request, grpc_context, None, pb.ModelInfoResponse
        )

    async def Check(self, request: Any, grpc_context: Any) -> Any:
        """The standard gRPC health ``Check``, answered by a replica."""
        from grpc_health.v1 import health_pb2

        return await self._unary(
            HEALTH_CHECK, request, grpc_context, None, health_pb2.HealthCheckResponse
        )

    async def Watch(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """The standard gRPC health ``Watch``: a replica's ``Check`` of the same service
        every second, a message at each change; ends UNAVAILABLE when this ingress
        is being stopped (:mod:`router.serve.health_watch`)."""
        from grpc_health.v1 import health_pb2

        async for status in watch_statuses(
            lambda: self._health_status(request, grpc_context), self.stop_sign.stopping
        ):
            yield health_pb2.HealthCheckResponse(status=status)
        grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
        grpc_context.set_details(INGRESS_STOPPING)
        raise RuntimeError(INGRESS_STOPPING)

    async def _health_status(self, request: Any, grpc_context: Any) -> tuple[int, str]:
        """One replica's ``Check`` of ``request.service`` as a ``Watch`` reports it:
        ``(status, why)``; a service the replica does not know is SERVICE_UNKNOWN, no
        answer within ``PROBE_TIMEOUT_S`` NOT_SERVING, with why."""
        from grpc_health.v1 import health_pb2

        response = health_pb2.HealthCheckResponse

        async def ask() -> tuple[int, str]:
            async for part in self._call_replica(HEALTH_CHECK, request, grpc_context, None):
                if not isinstance(part, GrpcStatus):
                    return response.FromString(part).status, ""
                if part.code == grpc.StatusCode.NOT_FOUND.value[0]:
                    return response.SERVICE_UNKNOWN, ""
                return response.NOT_SERVING, f"{_code_name(part.code)}: {part.details}"
            return response.NOT_SERVING, "the replica gave no answer"

        try:
            return await asyncio.wait_for(ask(), PROBE_TIMEOUT_S)
        except TimeoutError:
            return response.NOT_SERVING, f"no replica answered within {PROBE_TIMEOUT_S} s"
        except Exception as error:
            return response.NOT_SERVING, repr(error)


def _counter(name: str, documentation: str, label: str, counts: dict[str, int]) -> list[str]:
    """A counter family's exposition lines: one sample per ``counts`` key as ``label``."""
    lines = [f"# HELP {name} {documentation}", f"# TYPE {name} counter"]
    return lines + [f'{name}{{{label}="{key}"}} {count}' for key, count in sorted(counts.items())]


def _code_name(code: int) -> str:
    """The ``grpc.StatusCode`` name of a status number."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return "UNKNOWN"


async def _relay(stream: Any, path: str, streaming: bool) -> AsyncIterator[bytes]:
    """The body chunks of a replica's answer; if the replica is lost mid-answer, an
    error event ends an event stream (another body is cut, which the client sees)."""
    try:
        async for part in stream:
            yield part
    except Exception as error:
        logger.error("a streamed answer on {} lost its replica: {!r}", path, error)
        if streaming:
            _, content = error_body(path, 503, lost_replica_message(error), "unavailable")
            yield f"data: {json.dumps(content)}\n\n".encode()
