"""Ray set-up for the shard group: a local Ray instance the group fits on, and a
placement-group wait that says what is missing instead of hanging.

Ray places a group only when every bundle fits at once. A Ray instance started by
``ray.init()`` declares as many CPUs as the machine has cores, so ``--num-shard 3``
(3 x 1 CPU) would wait forever on a 2-core machine; the local executor simply runs
three processes there. The instance started here declares enough CPUs for the group,
like the local executor oversubscribing the cores. On an existing cluster nothing can
be declared: the wait logs what is missing every ``LOG_EVERY_S`` and gives up after
``--placement-timeout``.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

from loguru import logger

from router.startup_errors import PlacementError

# How often a placement-group wait logs what it is waiting for, seconds.
LOG_EVERY_S = 10.0


def start_local_ray(num_shard: int) -> None:
    """Start a Ray instance on this machine (never join one found running) with
    ``max(cores, num_shard)`` logical CPUs, so one 1-CPU bundle per rank fits."""
    import ray

    cores = os.cpu_count() or 1
    num_cpus = max(cores, num_shard)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    logger.info("started a local Ray instance with {} CPUs ({} cores, {} ranks)", num_cpus,
                cores, num_shard)


def check_local_gpus(num_shard: int) -> None:
    """Fail at once when this machine's Ray instance has fewer GPUs than ranks.

    Raises:
        PlacementError: names ``--num-shard`` and the GPU count.
    """
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < num_shard:
        raise PlacementError(
            f"--num-shard {num_shard} needs one GPU per rank; this machine has {gpus}"
        )


def shortfall(bundles: list[dict[str, float]], strategy: str) -> str:
    """What the cluster lacks to place ``bundles`` with ``strategy``, in words."""
    import ray

    needed: Counter[str] = Counter()
    for bundle in bundles:
        needed.update(bundle)
    available = ray.available_resources()
    total = ray.cluster_resources()
    missing = {
        name: amount - available.get(name, 0.0)
        for name, amount in needed.items() if amount > available.get(name, 0.0)
    }
    parts = []
    if missing:
        free_now = {name: available.get(name, 0.0) for name in needed}
        in_total = {name: total.get(name, 0.0) for name in needed}
        parts.append(f"missing {missing} (the group needs {dict(needed)}; free now "
                     f"{free_now} of {in_total})")
    if strategy == "STRICT_SPREAD":
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        if nodes < len(bundles):
            parts.append(f"one rank per node needs {len(bundles)} nodes, the cluster has {nodes}")
    if not parts:
        parts.append("enough resources in total, but no node (or set of nodes) can hold the "
                     "bundles as the strategy asks")
    return "; ".join(parts)


async def wait_for_placement(
    group: Any, bundles: list[dict[str, float]], strategy: str, timeout_s: float
) -> None:
    """Wait until ``group`` (a Ray placement group of ``bundles``) is placed.

    Logs what is missing every ``LOG_EVERY_S`` seconds, with a ``ray status`` hint.

    Raises:
        PlacementError: not placed within ``timeout_s`` seconds (``--placement-timeout``).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    ready = asyncio.ensure_future(group.ready())
    try:
        while True:
            remaining = deadline - loop.time()
            done, _ = await asyncio.wait({ready}, timeout=max(0.0, min(LOG_EVERY_S, remaining)))
            if done:
                ready.result()
                return
            waited = timeout_s - (deadline - loop.time())
            if loop.time() >= deadline:
                raise PlacementError(
                    f"the placement group of {len(bundles)} x {bundles[0]} ({strategy}) was not "
                    f"placed within {timeout_s:g} s (--placement-timeout): "
                    f"{shortfall(bundles, strategy)}; `ray status` shows the cluster"
                )
            logger.warning(
                "still waiting for a placement group of {} x {} ({}) after {:.0f} s: {}; "
                "run `ray status` to see the cluster's resources",
                len(bundles), bundles[0], strategy, waited, shortfall(bundles, strategy),
            )
    finally:
        ready.cancel()
