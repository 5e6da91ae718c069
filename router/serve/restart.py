"""``shardserve serve --rolling-restart on``: replace the replicas of a running
application one at a time, with new flags or a new model folder, dropping no call.

The command's flags are deployed over the running application (``--app-name`` on the
Ray cluster at ``--ray-address``) as ``serve.run`` updates an application in place:
every deployment gets a new version, so Ray Serve replaces its replicas by a rolling
update (Ray Serve docs, "Updating Applications In-Place"), the way
:func:`router.serve.app.build_app` sets: one ``Replica`` at a time
(``rolling_update_percentage``) and no surge (the old replica stops before its
replacement starts, which takes its resources). Ray Serve first takes the replica out
of every router's set (no new call reaches it), counts its ongoing calls every
``DRAIN_POLL_S`` until none is left or its own ``--graceful-timeout`` has passed (then
it is killed, and what it still had ends with the ingress's lost-replica error), and
starts the replacement; the next replica is stopped only once that one runs. The
ingress is replaced the other way round: its successor starts first, then the old one
drains the calls it relays.

While it waits, the command logs each change of the ``Replica`` deployment's replica
states (:func:`replica_states`) and returns once the application runs on new replicas
only. Interrupting it does not stop the rollout (Ray Serve's controller does it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from router.config import ServerConfig
from router.serve.config import ServeConfig

# The deployment whose replicas are replaced one at a time (router/serve/app.py).
REPLICA_DEPLOYMENT = "Replica"
# Seconds between two reads of the replicas' states.
WATCH_PERIOD_S = 0.5


def replica_states(app_name: str) -> dict[str, int]:
    """Ray Serve's count of ``app_name``'s ``Replica`` replicas by state (``RUNNING``,
    ``STOPPING``, ``STARTING``, ...); empty when the application does not run."""
    from ray import serve

    application = serve.status().applications.get(app_name)
    if application is None or REPLICA_DEPLOYMENT not in application.deployments:
        return {}
    states = application.deployments[REPLICA_DEPLOYMENT].replica_states
    return {str(getattr(state, "value", state)): count for state, count in states.items()}


def format_states(states: dict[str, int]) -> str:
    """``RUNNING=1 STARTING=1 STOPPING=1``: the states in name order (``none`` if empty)."""
    return " ".join(f"{state}={count}" for state, count in sorted(states.items())) or "none"


class StateLog:
    """Logs each change of an application's replica states from a thread, until
    :meth:`stop` (which reads them once more)."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-states", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last: dict[str, int] | None = None
        while True:
            stopping = self._stop.is_set()
            try:
                states = replica_states(self.app_name)
            except Exception as error:  # a missed read is logged, the next one follows
                logger.warning("reading the replica states failed: {}", error)
            else:
                if states != last:
                    logger.info("replica states: {}", format_states(states))
                    last = states
            if stopping:
                return
            self._stop.wait(WATCH_PERIOD_S)


def rolling_restart(
    config: ServerConfig,
    serve_config: ServeConfig,
    build_app: Callable[[ServerConfig, ServeConfig], Any],
) -> int:
    """Deploy ``build_app(config, serve_config)`` (:func:`router.serve.app.build_app`,
    called once Ray is joined) over the running application ``serve_config.app_name``
    and wait until every replica is new; return the exit code: 0 done, 1 no such
    application or the new replicas failed to start (Ray Serve keeps the old ones that
    still run), 2 no ``--ray-address``.

    ``--host``, ``--port`` and ``--grpc-port`` are those of the running proxies and are
    not changed.
    """
    import ray
    from ray import serve

    app_name = serve_config.app_name
    if config.ray_address is None:
        logger.error(
            "--rolling-restart needs --ray-address: the address that shardserve serve "
            "logged for its local Ray instance, or the cluster's"
        )
        return 2
    ray.init(address=config.ray_address, log_to_driver=False)
    try:
        before = replica_states(app_name)
        if not before:
            logger.error(
                "no application {} runs on {} (start it with shardserve serve)",
                app_name,
                config.ray_address,
            )
            return 1
        logger.info(
            "rolling restart of {} ({}): one replica at a time, each drained for up to "
            "its --graceful-timeout",
            app_name,
            format_states(before),
        )
        watch = StateLog(app_name)
        watch.start()
        started = time.monotonic()
        try:
            serve.run(build_app(config, serve_config), name=app_name, route_prefix="/")
        except RuntimeError as error:  # the new replicas failed (DEPLOY_FAILED)
            logger.error("rolling restart of {} failed: {}", app_name, error)
            return 1
        finally:
            watch.stop()
        logger.info("rolling restart of {} done in {:.1f} s", app_name, time.monotonic() - started)
        return 0
    finally:
        ray.shutdown()
