"""One replica of ``shardserve serve``: a whole server (router engine + its shard group)
inside a Ray Serve replica actor.

The replica's placement group is the one Ray Serve made for it (one bundle per rank,
:func:`router.serve.app.replica_bundles`); the replica actor itself takes no CPU and
sits in rank 0's bundle, so the group and its router stay together. Start-up is that of
``shardserve launch`` (:func:`~router.launcher.start_group`,
:func:`~router.launcher.build_engine`, the :class:`~router.launcher.Supervisor` that
restarts a failed shard group), without ports: HTTP calls are answered by the
replica's own FastAPI app in process (:mod:`router.serve.asgi_call`) and public gRPC
calls by its own gRPC servicer on a loopback port, so every route, check and error is
the one-replica server's.

What the request router reads (``record_routing_stats``): waiting and running
requests, KV blocks total and used, prefix-cache hit tokens. ``check_health`` fails once
the shard group is down with no restart left, and Ray Serve replaces the replica.
On shutdown (scale-down, rolling restart, deletion) Ray Serve stops routing to the
replica and counts its ongoing calls until none is left, then calls ``__del__``, which
stops the engine and the shards. Calls still running after ``--graceful-timeout`` are
not waited for: Ray Serve kills the replica, and the ingress ends them with its
lost-replica error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from loguru import logger

from router.api.app import create_app
from router.api.server import make_state
from router.config import ServerConfig
from router.grpc_api.server import start_grpc_server
from router.launcher import (
    SHARD_START_TIMEOUT_S,
    SHUTDOWN_MESSAGE,
    Supervisor,
    build_engine,
    start_group,
)
from router.log import setup_logging
from router.serve.affinity import RouteHint
from router.serve.asgi_call import HttpCall, HttpStart, run_asgi
from router.serve.board import PUBLISH_EVERY_S, ReplicaBoard
from router.step_trace import step_trace

# Name and namespace of the board actor of an application (see router/serve/board.py).
BOARD_NAMESPACE = "shardserve"


def board_name(app_name: str) -> str:
    """The named Ray actor holding ``app_name``'s replica posts."""
    return f"board-{app_name}"


def get_board(app_name: str) -> Any:
    """The board actor of ``app_name``, created (detached, no CPU) if none exists."""
    import ray

    actor = ray.remote(ReplicaBoard).options(
        name=board_name(app_name),
        namespace=BOARD_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
    )
    return actor.remote()


@dataclass(frozen=True)
class GrpcStatus:
    """A public gRPC call that ended in an error: its status code's number and details."""

    code: int
    details: str


class ReplicaServer:
    """A Ray Serve deployment class: one replica.

    Args:
        config: The server's flags (``shardserve serve`` parses the same as ``launch``).
        app_name: The Serve application's name (which board to post to).
    """

    async def __init__(self, config: ServerConfig, app_name: str) -> None:  # type: ignore[misc]
        import ray
        from ray import serve

        from router.executors import RayExecutor

        setup_logging(json_output=config.shard.json_logs)
        self.config = config
        self.app_name = app_name
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.executor = RayExecutor(
            config.shard,
            placement=config.placement,
            placement_timeout_s=config.placement_timeout_s,
            placement_group=ray.util.get_current_placement_group(),
        )
        self._tasks: list[asyncio.Future[None]] = []
        self._started = False
        logger.info("replica {}: starting {} shard(s)", self.replica_id, config.shard.world_size)
        try:
            client = await start_group(
                self.executor,
                SHARD_START_TIMEOUT_S,
                config.step_timeout_s,
                step_trace(config.shard.step_trace_dir),
            )
        except BaseException:
            await self.executor.stop()
            raise
        try:
            self.engine, facts, warmup = await build_engine(config, client)
        except BaseException:
            await client.close()
            await self.executor.stop()
            raise
        self.engine.start()
        self.state = make_state(
            self.engine, self.engine.scheduler, self.engine.tokenizer, facts, config
        )
        self.app = create_app(self.state)
        self.grpc_server, port = await start_grpc_server(
            self.state, "127.0.0.1", 0, draining=lambda: self.engine.draining
        )
        self.channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
        )
        self.supervisor = Supervisor(
            self.executor, self.engine, config, warmup, on_give_up=lambda: None
        )
        self.board = get_board(app_name)
        self._tasks = [
            asyncio.ensure_future(self.supervisor.run()),
            asyncio.ensure_future(self._publish()),
        ]
        self._started = True
        logger.info("replica {} serving {}", self.replica_id, facts.model_id)

    async def http(
        self, call: HttpCall, route: RouteHint | None = None
    ) -> AsyncIterator[HttpStart | bytes]:
        """Answer an HTTP call with the replica's app (``route``: read by the request
        router only)."""
        async for part in run_asgi(self.app, call):
            yield part

    async def grpc(
        self,
        method: str,
        request: bytes,
        metadata: tuple[tuple[str, str], ...],
        route: RouteHint | None = None,
    ) -> AsyncIterator[bytes | GrpcStatus]:
        """Answer a public gRPC call (``method``: its full path, e.g.
        ``/shardserve.generate.v1.TextGeneration/GenerateStream``; ``request``: the
        serialized message) with the replica's servicer: the serialized answers, or a
        :class:`GrpcStatus` last when the call failed."""
        try:
            if method.endswith("Stream"):
                async for message in self.channel.unary_stream(method)(request, metadata=metadata):
                    yield message
            else:
                yield await self.channel.unary_unary(method)(request, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            yield GrpcStatus(error.code().value[0], error.details() or "")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router weighs (read by Ray Serve every
        ``request_routing_stats_period_s``): requests waiting and running, KV blocks
        total and used, prefix-cache hit tokens (cumulative), tokens per block."""
        status = self.engine.status()
        return {
            "queue_size": status.queue_size,
            "running": status.running,
            "kv_blocks_total": status.kv_blocks_total,
            "kv_blocks_used": status.kv_blocks_used,
            "prefix_cache_hit_tokens": status.prefix_cache_hit_tokens,
            "block_size": status.block_size,
        }

    async def check_health(self) -> None:
        """Raise once the shard group is down for good (Ray Serve then replaces this
        replica); a group being restarted still counts as healthy.

        Raises:
            RuntimeError: no shard-group restart left (``--max-restarts``).
        """
        if self.supervisor.gave_up:
            raise RuntimeError(
                f"replica {self.replica_id}: its shard group is down and "
                "no restart is left (--max-restarts)"
            )

    async def _publish(self) -> None:
        """Post the replica's metrics to the board every ``PUBLISH_EVERY_S``."""
        while True:
            try:
                await self.board.publish.remote(self.replica_id, await self.engine.render_metrics())
            except Exception as error:  # the board is recreated by the next get_board
                logger.warning("replica {}: posting metrics failed: {}", self.replica_id, error)
                self.board = get_board(self.app_name)
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def __del__(self) -> None:
        """Stop the engine, the gRPC server and the shard group once Ray Serve has
        drained the replica (a call that came in meanwhile is failed with a message
        naming the shutdown); nothing to do when the constructor failed: it stopped
        what it had started."""
        if not self._started:
            return
        logger.info("replica {} stopping", self.replica_id)
        self.engine.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.board.remove.remote(self.replica_id)
        await self.engine.stop()
        self.engine.fail_all(SHUTDOWN_MESSAGE, include_waiting=True)
        await self.grpc_server.stop(grace=1.0)
        await self.channel.close()
        await self.engine.shards.client.close()
        await self.executor.stop()
