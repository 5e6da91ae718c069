"""Start, watch and stop the shard group: as Ray actors (default) or as local processes.

Both give the launcher the gRPC address of every rank, in rank order, and hand every
rank the torch.distributed rendezvous (rank 0's IP and a free port on it). Both answer
:meth:`~ShardExecutor.dead_rank` so the launcher can restart a group that lost a rank.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import socket
import subprocess
import sys
from typing import Any, Protocol

import grpc
from loguru import logger

from router.log import announce_wait
from router.startup_errors import StartupError  # also the launcher's name for it
from shard.config import ENV_PREFIX, ShardConfig
from shard.config_flags import shard_argv
from shard.pb import shard_pb2, shard_pb2_grpc

LIVENESS_TIMEOUT_S = 5.0
# A probe's channel retries a refused connection at least this often (gRPC's default
# backoff grows to 120 s while a rank loads its model; a call made during that backoff
# would fail at once although the rank has been listening for long).
PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ShardExecutor(Protocol):
    """Starts the shard group; ``start`` returns each rank's ``host:port``."""

    async def start(self) -> list[str]: ...

    async def dead_rank(self) -> int | None: ...

    def mark_ready(self) -> None:
        """Every rank has answered Health: from now on one that stops answering is hung."""

    async def stop_group(self, grace_s: float = 15.0) -> None: ...

    async def stop(self) -> None: ...

    @property
    def exit_at_once(self) -> bool:
        """After :meth:`stop`: the process must end without the interpreter's teardown
        (a library's state there would block or crash it)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class HealthProbe:
    """Pings one rank's gRPC ``Health``; a rank that answered once and then stops
    answering within ``LIVENESS_TIMEOUT_S`` is hung (stopped, deadlocked, swapping).

    A rank that never answered yet is still loading its model and is not judged. The
    ping waits for the channel to connect (``wait_for_ready``), so only a rank that
    cannot be reached or does not answer for ``timeout_s`` seconds counts as hung.

    Args:
        address: ``host:port`` of the rank's gRPC server.
        timeout_s: seconds a ping may take.
    """

    def __init__(self, address: str, timeout_s: float = LIVENESS_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.answered = False
        self._channel = grpc.aio.insecure_channel(address, options=PROBE_CHANNEL_OPTIONS)
        self._stub = shard_pb2_grpc.ShardServiceStub(self._channel)

    async def hung(self) -> bool:
        """True when the rank answered before (or the group is ready) but not now."""
        try:
            await self._stub.Health(shard_pb2.HealthRequest(), timeout=self.timeout_s,
                                    wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            if self.answered:
                logger.error("shard at {} did not answer Health: {}: {}", self.address,
                             error.code().name, error.details())
            return self.answered
        self.answered = True
        return False

    async def close(self) -> None:
        await self._channel.close()


class LocalExecutor:
    """Each rank as a ``python -m shard.server`` child process on this machine, started
    with the flags :func:`~shard.config_flags.shard_argv` spells its configuration as.

    Args:
        config: what to start (``world_size`` ranks).
        host: interface the shards bind (and rank 0's rendezvous address).
        master_port: rendezvous port; 0 picks a free one at each start.
    """

    def __init__(
        self, config: ShardConfig, host: str = "127.0.0.1", master_port: int = 0
    ) -> None:
        self.config = config
        self.host = host
        self.master_port = master_port
        self.processes: list[subprocess.Popen[bytes]] = []
        self.probes: list[HealthProbe] = []

    async def start(self) -> list[str]:
        addresses = []
        master_port = self.master_port or free_port(self.host)
        for rank in range(self.config.world_size):
            port = free_port(self.host)
            # parent_pid: a shard stops by itself once this process is gone (killed
            # before it could stop the group), instead of holding its memory on
            config = dataclasses.replace(self.config.for_rank(rank, self.host, master_port),
                                         parent_pid=os.getpid())
            args = shard_argv(config, host=self.host, port=port)
            # Every shard setting is a flag: the router's SHARDSERVE_* variables stay out.
            env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
            # A session of its own: Ctrl-C on the terminal reaches the launcher, which
            # drains the running requests and then stops the shards, not the shards first.
            process = subprocess.Popen([sys.executable, "-m", "shard.server", *args], env=env,
                                       start_new_session=True)
            self.processes.append(process)
            logger.info("shard rank {}: pid {} on node local at {}:{}", rank, process.pid,
                        self.host, port)
            addresses.append(f"{self.host}:{port}")
        logger.info("waiting for {} shard process(es) to load the model", len(addresses))
        self.probes = [HealthProbe(address) for address in addresses]
        return addresses

    def mark_ready(self) -> None:
        """The group answered Health (start-up is over): a rank stopped before its probe
        ever got an answer is judged hung too, not taken for one still loading."""
        for probe in self.probes:
            probe.answered = True

    async def dead_rank(self) -> int | None:
        """A rank whose process has exited, or that stopped answering Health (pinged
        with a ``LIVENESS_TIMEOUT_S`` timeout, every rank at once), if any."""
        for rank, process in enumerate(self.processes):
            if process.poll() is not None:
                return rank
        hung = await asyncio.gather(*(probe.hung() for probe in self.probes))
        return next((rank for rank, is_hung in enumerate(hung) if is_hung), None)

    async def stop_group(self, grace_s: float = 15.0) -> None:
        """SIGTERM every rank, SIGKILL those still alive after ``grace_s`` seconds (a
        rank blocked in a collective with a dead peer may never exit by itself)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.to_thread(process.wait, grace_s)
            except subprocess.TimeoutExpired:
                process.kill()  # also ends a stopped (SIGSTOP) process
                await asyncio.to_thread(process.wait)
        self.processes = []
        await asyncio.gather(*(probe.close() for probe in self.probes))
        self.probes = []

    async def stop(self) -> None:
        await self.stop_group()

    @property
    def exit_at_once(self) -> bool:
        return False


def _all_on_this_node(places: list[dict[str, Any]]) -> bool:
    """Whether every rank (``ShardActor.where`` answers) runs on the router's node, so
    the shards can bind loopback. Never through Ray Client (``ray://``), where the
    driver's node is the cluster's head, not the router's machine."""
    import ray

    if ray.util.client.ray.is_connected():
        return False
    here = ray.get_runtime_context().get_node_id()
    return all(place["node_id"] == here for place in places)


class RayExecutor:
    """One Ray actor (:class:`shard.actor.ShardActor`) per rank in a placement group (one
    bundle per rank); each actor gets the configuration object itself (Ray pickles it).

    Args:
        config: What to start (``world_size`` ranks).
        ray_address: An existing cluster to join; ``None`` starts a local Ray instance
            that the group fits on (see :mod:`router.ray_placement`).
        placement: ``"pack"`` (default) or ``"spread"`` (``STRICT_SPREAD``: one rank
            per node; fails to place with fewer nodes than ranks).
        placement_timeout_s: How long to wait for the placement group, seconds.
        placement_group: A placement group made for the ranks by someone else (a Ray
            Serve replica's: bundle ``rank`` holds rank ``rank``), used as it is and
            never removed here; None = make one (and remove it in :meth:`stop_group`).
    """

    def __init__(
        self, config: ShardConfig, ray_address: str | None = None, placement: str = "pack",
        placement_timeout_s: float = 300.0, placement_group: Any = None,
    ) -> None:
        self.config = config
        self.ray_address = ray_address
        self.placement = placement
        self.placement_timeout_s = placement_timeout_s
        self.actors: list[Any] = []
        self._given_group = placement_group
        self._placement_group: Any = None
        self._started_ray = False
        self._ray_lost = False

    async def start(self) -> list[str]:
        """Place the group, start one actor per rank; each rank's ``host:port``.

        Raises:
            PlacementError: the group cannot be placed (not enough GPUs on this
                machine, or nothing placed within ``placement_timeout_s``).
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from router.ray_placement import check_local_gpus, start_local_ray, wait_for_placement
        from shard.actor import ShardActor

        num_shard = self.config.world_size
        if self._local_ray_lost():
            raise StartupError("the local Ray instance is gone; start the server again")
        if not ray.is_initialized():
            if not (sys.stdout.isatty() and sys.stderr.isatty()):
                # Shard lines reach our log through log_to_driver with a "(ShardActor
                # pid=N)" prefix, ANSI-coloured unless this is 0: no escapes in log files.
                os.environ.setdefault("RAY_COLOR_PREFIX", "0")
            if self.ray_address is None:
                start_local_ray(num_shard)
            else:
                ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        use_gpu = self.config.device.startswith("cuda") or (
            self.config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        if use_gpu and self.ray_address is None:
            check_local_gpus(num_shard)
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        strategy = "STRICT_SPREAD" if self.placement == "spread" else "PACK"
        bundles = [bundle] * num_shard
        if self._given_group is not None:
            group = self._given_group  # placed already (its owner waited for it)
        else:
            group = self._placement_group = placement_group(bundles, strategy=strategy)
            logger.info("waiting for a placement group of {} x {} ({})", num_shard, bundle,
                        strategy)
            await wait_for_placement(group, bundles, strategy, self.placement_timeout_s)
        logger.info("placement group ready; starting {} shard actor(s)", num_shard)
        actor_class = ray.remote(ShardActor)
        for rank in range(num_shard):
            options = actor_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            )
            self.actors.append(options.remote(self.config, rank))
        places = await asyncio.gather(*(actor.where.remote() for actor in self.actors))
        for rank, place in enumerate(places):
            logger.info("shard rank {}: pid {} on node {} at {}", rank, place["pid"],
                        place["node_id"], place["ip"])
        loopback = _all_on_this_node(places)
        if loopback:
            logger.info("every rank runs on this node: shard gRPC servers bind 127.0.0.1")
        master_addr, master_port = await self.actors[0].rendezvous.remote()
        logger.info("waiting for {} shard(s) to join the process group and load the model",
                    num_shard)
        # NOTE: all at once: each start blocks in init_process_group until every rank joins.
        starts = [actor.start.remote(master_addr, master_port, loopback) for actor in self.actors]
        return list(await announce_wait(asyncio.gather(*starts), "the shards to load the model"))

    def mark_ready(self) -> None:
        """Nothing to do: actors are pinged by method call, not judged by a probe."""

    async def dead_rank(self) -> int | None:
        """The first rank whose actor does not answer a ping within 5 s, if any."""
        import ray

        for rank, actor in enumerate(self.actors):
            try:
                await asyncio.wait_for(actor.ping.remote(), LIVENESS_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                return rank
        return None

    async def stop_group(self, grace_s: float = 10.0) -> None:
        """Stop every actor's server (``grace_s`` seconds at most), kill the actors,
        release the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._local_ray_lost():
            self.actors = []
            self._placement_group = None
            return
        for actor in self.actors:
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=grace_s)
            except Exception as error:
                logger.warning("stopping a shard actor: {}", error)
            ray.kill(actor)
        self.actors = []
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None

    async def stop(self) -> None:
        import ray

        await self.stop_group()
        if self._ray_lost:
            # ray.shutdown() and Ray's own exit hook would wait 60 s for the lost GCS and
            # then end the process; its C++ core crashes in the interpreter's teardown.
            import ray._private.worker as ray_worker

            node = ray_worker._global_node
            if node is not None:
                node.kill_all_processes(check_alive=False, allow_graceful=False)
            atexit.unregister(ray_worker.shutdown)
        elif self._started_ray:
            ray.shutdown()

    @property
    def exit_at_once(self) -> bool:
        return self._ray_lost

    def _local_ray_lost(self) -> bool:
        """Whether the Ray instance this executor started on this machine lost one of
        its processes (raylet, GCS, ...): a signal sent to the whole process group
        (``kill -- -PGID``, ``timeout``, systemd's default ``KillMode``) reaches them
        as it reaches the launcher. Its actors are gone with the raylet, and any Ray
        call would wait for the GCS. Checked without a Ray call (the processes' exit
        status, as Ray's ``Node.dead_processes`` reads it)."""
        if not self._ray_lost and self._started_ray and self.ray_address is None:
            import ray._private.worker as ray_worker

            node = ray_worker._global_node
            dead: list[tuple[str, Any]] = node.dead_processes() if node is not None else []
            if dead:
                logger.warning(
                    "the local Ray instance was stopped too ({} exited): a signal sent to "
                    "the whole process group reaches it; its shard actors went with it",
                    ", ".join(sorted({kind for kind, _ in dead})))
                self._ray_lost = True
        return self._ray_lost
