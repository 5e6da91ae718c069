"""Start the public gRPC server: TextGeneration + standard health + server reflection.

Stock tools work against it: ``grpcurl -plaintext HOST:PORT list`` (reflection) and
``grpc_health_probe`` (``grpc.health.v1.Health``, SERVING once the engine is up).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.api.state import ServerState
from router.grpc_api.servicer import TextGenerationServicer
from router.pb import generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name


async def start_grpc_server(
    state: ServerState, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Serve the public gRPC API on ``host:port`` (port 0 = any free port).

    Returns:
        The started server and the port it listens on.

    Raises:
        RuntimeError: the port could not be bound.
    """
    # Requests are bounded like HTTP bodies (--max-request-bytes); answers are not.
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", state.max_request_bytes)]
    )
    generate_pb2_grpc.add_TextGenerationServicer_to_server(TextGenerationServicer(state), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
