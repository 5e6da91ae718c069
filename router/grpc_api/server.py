"""Start the public gRPC server: TextGeneration + standard health + server reflection.

Stock tools work against it: ``grpcurl -plaintext HOST:PORT list`` (reflection) and
``grpc_health_probe`` (``grpc.health.v1.Health``: SERVING exactly when ``GET /health``
answers 200). With ``--api-key`` every call but health checks needs ``authorization:
Bearer <key>`` metadata (``grpcurl -H 'authorization: Bearer KEY'``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.api.state import ServerState
from router.grpc_api.auth import ApiKeyInterceptor
from router.grpc_api.malformed import MalformedRequestInterceptor
from router.grpc_api.servicer import TextGenerationServicer
from router.pb import generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
# How often a Watch stream re-checks health, seconds.
WATCH_REFRESH_S = 1.0


class HealthServicer(health.aio.HealthServicer):
    """``grpc.health.v1.Health`` following ``GET /health``: each Check asks the same
    question (:meth:`router.engine.loop.Engine.health_problem`, answered at once from the
    known state, never by calling a shard) for ``""`` and the TextGeneration service;
    Watch streams re-ask it every ``WATCH_REFRESH_S``."""

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self._state = state

    async def refresh(self) -> None:
        """Set both services' status from the server's health now."""
        problem = await self._state.engine.health_problem()
        status = (health_pb2.HealthCheckResponse.SERVING if problem is None
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.set(name, status)

    async def Check(  # type: ignore[override]
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(  # type: ignore[override]
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.refresh()
        refresher = asyncio.ensure_future(self._refresh_every(WATCH_REFRESH_S))
        try:
            await super().Watch(request, context)
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher

    async def _refresh_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.refresh()


async def start_grpc_server(
    state: ServerState, host: str, port: int, reuse_port: bool = False,
    draining: Callable[[], bool] = lambda: False,
) -> tuple[grpc.aio.Server, int]:
    """Serve the public gRPC API on ``host:port`` (port 0 = any free port).

    ``reuse_port``: bind with ``SO_REUSEPORT``, so that several API processes serve the
    port; off, a port another process holds is an error (gRPC's default would share it).
    ``draining``: whether the server is shutting down; a generation that fails then is
    answered UNAVAILABLE (retry elsewhere), not INTERNAL.

    Returns:
        The started server and the port it listens on.

    Raises:
        RuntimeError: the port could not be bound.
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
    if state.api_key:
        interceptors.insert(0, ApiKeyInterceptor(state.api_key))
    # Requests are bounded like HTTP bodies (--max-request-bytes); answers are not.
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", state.max_request_bytes),
                 ("grpc.so_reuseport", int(reuse_port))],
    )
    generate_pb2_grpc.add_TextGenerationServicer_to_server(
        TextGenerationServicer(state, draining), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(state), server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    return server, bound
