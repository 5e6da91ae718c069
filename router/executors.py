"""Start and stop the shard group: as Ray actors (default) or as local processes.

Both give the launcher the gRPC address of every rank, in rank order.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from typing import Any, Protocol

from loguru import logger

from router.config import ShardLaunchConfig


class ShardExecutor(Protocol):
    """Starts the shard group; ``start`` returns each rank's ``host:port``."""

    async def start(self) -> list[str]: ...

    async def stop(self) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalExecutor:
    """Each rank as a ``python -m shard.server`` child process on this machine."""

    def __init__(self, config: ShardLaunchConfig, host: str = "127.0.0.1") -> None:
        self.config = config
        self.host = host
        self.processes: list[subprocess.Popen[bytes]] = []

    async def start(self) -> list[str]:
        addresses = []
        for rank in range(self.config.num_shard):
            port = free_port(self.host)
            args = self.config.shard_args(rank=rank, port=port, host=self.host)
            self.processes.append(subprocess.Popen([sys.executable, "-m", "shard.server", *args]))
            addresses.append(f"{self.host}:{port}")
        return addresses

    def failed_rank(self) -> int | None:
        """A rank whose process has exited, if any."""
        for rank, process in enumerate(self.processes):
            if process.poll() is not None:
                return rank
        return None

    async def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.to_thread(process.wait, 15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes = []


class ShardActor:
    """Ray actor hosting one rank's gRPC server in the actor's event loop."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self._server: Any = None

    async def start(self) -> str:
        """Load the model, start the gRPC server; return its ``host:port``."""
        import ray

        from shard.server import config_from_args, configure_logging, start_server

        config, _, _ = config_from_args(self.args)
        configure_logging(config.rank)
        host = ray.util.get_node_ip_address()
        self._server, port = await start_server(config, host=host, port=0)
        return f"{host}:{port}"

    async def stop(self) -> None:
        """Stop the gRPC server."""
        if self._server is not None:
            await self._server.stop(grace=5)


class RayExecutor:
    """One Ray actor per rank in a placement group (one bundle per rank).

    Args:
        config: What to start.
        ray_address: An existing cluster to join; ``None`` starts a local Ray instance.
        placement: ``"pack"`` (default) or ``"spread"`` ranks over nodes.
    """

    def __init__(
        self, config: ShardLaunchConfig, ray_address: str | None = None, placement: str = "pack"
    ) -> None:
        self.config = config
        self.ray_address = ray_address
        self.placement = placement
        self.actors: list[Any] = []
        self._placement_group: Any = None
        self._started_ray = False

    async def start(self) -> list[str]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        use_gpu = self.config.device.startswith("cuda") or (
            self.config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        strategy = "STRICT_SPREAD" if self.placement == "spread" else "PACK"
        self._placement_group = placement_group([bundle] * self.config.num_shard, strategy=strategy)
        logger.info("waiting for a placement group of {} x {}", self.config.num_shard, bundle)
        await self._placement_group.ready()
        actor_class = ray.remote(ShardActor)
        for rank in range(self.config.num_shard):
            options = actor_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group, placement_group_bundle_index=rank
                ),
            )
            self.actors.append(options.remote(self.config.shard_args(rank=rank, port=0)))
        return list(await asyncio.gather(*(actor.start.remote() for actor in self.actors)))

    async def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=10)
            except Exception as error:
                logger.warning("stopping a shard actor: {}", error)
            ray.kill(actor)
        self.actors = []
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._started_ray:
            ray.shutdown()
