"""One shard as a Ray actor: the launcher's Ray executor creates one per rank.

The actor is built from a :class:`~shard.config.ShardConfig` (pickled by Ray) and its
rank; the rendezvous (rank 0's address and port) is known only once every actor is
placed, so :meth:`ShardActor.start` receives it. Nothing here imports torch at import
time (the model is loaded inside :meth:`ShardActor.start`, in the actor's process), so
the router can name this class without loading the shard runtime.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from shard.config import ShardConfig


def _free_port() -> int:
    """A TCP port free on every interface of this node right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


class ShardActor:
    """Ray actor hosting one rank's gRPC server in the actor's event loop.

    Args:
        config: The group's shard configuration (``world_size`` ranks).
        rank: This actor's tensor-parallel rank.
    """

    def __init__(self, config: ShardConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self._server: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a port free on it (asked of rank 0 before any start)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def where(self) -> dict[str, Any]:
        """``{"pid", "node_id", "ip"}`` of this actor's worker process."""
        import ray

        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    async def start(self, master_addr: str, master_port: int, loopback: bool = False) -> str:
        """Join the process group, load the model, start the gRPC server; return its
        ``host:port``. Runs concurrently on every rank (the rendezvous waits for all).

        Args:
            master_addr: Rank 0's IP.
            master_port: The rendezvous port on rank 0.
            loopback: Bind 127.0.0.1 (the router runs on this node) instead of the
                node's IP, so the shard service is not reachable from the network.

        Raises:
            ValueError: the configuration is invalid for this rank.
        """
        import ray

        from shard.server import configure_logging, start_server

        config = self.config.for_rank(self.rank, master_addr, master_port)
        configure_logging(config.rank, config.json_logs)
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        self._server, port = await start_server(config, host=host, port=0)
        return f"{host}:{port}"

    async def ping(self) -> bool:
        """Liveness probe."""
        return True

    async def stop(self) -> None:
        """Stop the gRPC server."""
        if self._server is not None:
            await self._server.stop(grace=5)
