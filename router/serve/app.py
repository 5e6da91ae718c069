"""``shardserve serve``: N replicas as one Ray Serve application.

The application is two deployments: ``Replica`` (:class:`~router.serve.replica.ReplicaServer`,
``--replicas`` of them, autoscaled on ongoing requests between ``--min-replicas`` and
``--max-replicas``, each in a placement group of one bundle per rank) routed by
:class:`~router.serve.request_router.ShardserveRequestRouter`, and ``Ingress``
(:class:`~router.serve.ingress.Ingress`) behind Ray Serve's HTTP proxy (``--host``,
``--port``) and gRPC proxy (``--grpc-port``).

Locally, a Ray instance is started with enough logical CPUs for the most replicas'
ranks (as ``launch`` does for one group); with ``--ray-address`` the application runs on
that cluster. On a Ray cluster managed by KubeRay, a ``RayService`` deploys
:func:`router.serve.builder.app_builder` with the same flags (``deploy/kuberay-service/``).

A rolling restart (``--rolling-restart on``, :mod:`router.serve.restart`: these
deployments deployed again over the running application) replaces the replicas one at a
time, as scale-down stops them: Ray Serve routes no new call to a stopping replica,
waits up to its ``--graceful-timeout`` for the calls it has, then stops it (or kills
it, cutting what is left) and starts its replacement. The ingress is replaced too
(Ray Serve gives every deployment a new version at each deploy): its successor starts
first, and it relays the calls it has until their replicas end them.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from loguru import logger

from router.config import ServerConfig
from router.serve.config import ServeConfig

# gRPC services Ray Serve's gRPC proxy serves (the ingress has a method for each call:
# TextGeneration's four, and the health service's Check and Watch).
GRPC_SERVICERS = [
    "router.serve.grpc_services.add_text_generation",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
# Seconds between two ``record_routing_stats`` reads of a replica, and their deadline.
ROUTING_STATS_PERIOD_S = 0.5
ROUTING_STATS_TIMEOUT_S = 5.0
# Health checks of a replica (``check_health``): period and deadline, seconds.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# Calls the ingress replica takes at once.
INGRESS_MAX_ONGOING = 4096
# Seconds a stopping ingress may go on relaying its calls. NOTE: a rolling restart
# replaces the ingress at once (Ray Serve versions every deployment anew at each
# deploy) while the replicas serving its calls are drained later, one at a time, each
# for up to its --graceful-timeout: the old ingress must outlive them. It does not
# outlive them by much (a call whose replica is gone ends with the lost-replica
# error), so this bound is a safeguard only.
INGRESS_DRAIN_LIMIT_S = 3600.0
# Seconds between two counts of a stopping replica's calls (Ray Serve's default: 2 s,
# which a drained replica would sit out before it is replaced).
DRAIN_POLL_S = 0.5


def replica_bundles(config: ServerConfig, use_gpu: bool) -> list[dict[str, float]]:
    """One placement-group bundle per rank of a replica (1 CPU, and 1 GPU on GPUs), as
    ``launch``'s group has; the replica actor (no CPU) shares rank 0's."""
    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    return [dict(bundle) for _ in range(config.shard.world_size)]


def one_at_a_time(max_replicas: int) -> float:
    """Ray Serve's ``rolling_update_percentage`` that updates one replica at a time:
    it updates ``max(int(fraction * replicas), 1)`` at once, so any fraction below
    ``1 / max_replicas`` means one."""
    return 1.0 / (max_replicas + 1)


def scaling_options(serve_config: ServeConfig) -> dict[str, Any]:
    """The ``Replica`` deployment's options on its replica count: ``num_replicas``, or
    with autoscaling Ray Serve's ``autoscaling_config`` (bounds, target ongoing
    requests per replica, and the delays in seconds before it adds or stops replicas)."""
    if not serve_config.autoscaling:
        return {"num_replicas": serve_config.replicas}
    low, high = serve_config.scale_bounds
    return {
        "autoscaling_config": {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": serve_config.replicas,
            "target_ongoing_requests": serve_config.target_ongoing_requests,
            "upscale_delay_s": serve_config.upscale_delay_s,
            "downscale_delay_s": serve_config.downscale_delay_s,
        }
    }


def _uses_gpu(config: ServerConfig) -> bool:
    import ray

    device = config.shard.device
    return device.startswith("cuda") or (
        device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )


def build_app(config: ServerConfig, serve_config: ServeConfig) -> Any:
    """The Ray Serve application (``Ingress`` bound to ``Replica``), on a running Ray."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from router.serve.ingress import Ingress
    from router.serve.replica import ReplicaServer
    from router.serve.request_router import ShardserveRequestRouter

    high = serve_config.scale_bounds[1]
    router_options: dict[str, Any] = {
        "request_router_class": ShardserveRequestRouter,
        "request_router_kwargs": {
            "policy": serve_config.routing,
            "max_gap": serve_config.affinity_max_gap,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": ROUTING_STATS_TIMEOUT_S,
    }
    deployment: Any = serve.deployment  # typed as a decorator only
    replica = deployment(
        ReplicaServer,
        name="Replica",
        ray_actor_options={"num_cpus": 0},
        placement_group_bundles=replica_bundles(config, _uses_gpu(config)),
        placement_group_strategy="STRICT_SPREAD" if config.placement == "spread" else "PACK",
        max_ongoing_requests=config.scheduler.max_concurrent_requests,
        graceful_shutdown_timeout_s=float(config.graceful_timeout_s),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        # NOTE: no version: every deploy replaces every replica (a rolling restart). No
        # surge (Ray Serve's default): a replacement would need a spare replica's GPUs.
        rolling_update_percentage=one_at_a_time(high),
        max_surge_percent=0,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=RequestRouterConfig(**router_options),
        **scaling_options(serve_config),
    )
    ingress = deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_timeout_s=INGRESS_DRAIN_LIMIT_S,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        # a new ingress (no CPU) starts before the old one stops relaying
        max_surge_percent=100,
        num_replicas=1,
    )
    return ingress.bind(replica.bind(config, serve_config.app_name), config, serve_config.app_name)


def run(config: ServerConfig, serve_config: ServeConfig) -> int:
    """Blocking entry point of ``shardserve serve``: deploy, serve until SIGINT or
    SIGTERM, then delete the application (replicas drain for ``--graceful-timeout``).
    With ``--rolling-restart on``: :func:`router.serve.restart.rolling_restart`."""
    import ray
    from ray import serve

    if serve_config.rolling_restart:
        from router.serve.restart import rolling_restart

        return rolling_restart(config, serve_config, build_app)
    low, high = serve_config.scale_bounds
    if config.ray_address is None:
        num_cpus = max(os.cpu_count() or 1, high * config.shard.world_size)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        logger.info(
            "started a local Ray instance at {} with {} CPUs for up to {} replica(s) of {} rank(s)",
            ray.get_runtime_context().gcs_address,
            num_cpus,
            high,
            config.shard.world_size,
        )
    else:
        ray.init(address=config.ray_address, log_to_driver=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    grpc_options = (
        {
            "port": config.grpc_port,
            "grpc_servicer_functions": GRPC_SERVICERS,
            # the proxy answers server reflection itself (ray-project/ray#65854)
            "enable_reflection": True,
        }
        if config.grpc_port
        else None
    )
    serve.start(http_options={"host": config.host, "port": config.port}, grpc_options=grpc_options)
    try:
        logger.info(
            "deploying {} replica(s) ({}-{}), routing by {}",
            serve_config.replicas,
            low,
            high,
            serve_config.routing,
        )
        serve.run(
            build_app(config, serve_config),
            name=serve_config.app_name,
            route_prefix="/",
            blocking=False,
        )
        if config.grpc_port:
            logger.info("serving the gRPC API on {}:{}", config.host, config.grpc_port)
        logger.info("serving on http://{}:{}", config.host, config.port)
        stop.wait()
        logger.info("draining (graceful timeout {} s)", config.graceful_timeout_s)
        serve.delete(serve_config.app_name)
    finally:
        _remove_board(serve_config.app_name)
        serve.shutdown()
        ray.shutdown()
        logger.info("stopped")
    return 0


def _remove_board(app_name: str) -> None:
    """Kill the application's board actor (detached, so it outlives the replicas)."""
    import ray

    from router.serve.replica import BOARD_NAMESPACE, board_name

    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE))
    except ValueError:
        pass  # never created
