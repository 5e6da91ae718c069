"""Whether the server can serve: one answer for ``GET /health`` and gRPC health.

Unhealthy while draining (SIGTERM, or no shard-group restart left), while a shard does
not answer ``Health`` within 5 s (dead, hung, restarting), and for a while after a
failed step (see :attr:`router.engine.Engine.healthy`).
"""

from __future__ import annotations

import asyncio

from loguru import logger

from router.api.state import ServerState


async def health_problem(state: ServerState) -> str | None:
    """Why the server is not healthy, or None when it is.

    Never raises for a shard failure: a call cancelled under it (the shard group's
    channels closing during a restart) is an answer too, not an error. Only the
    cancellation of the caller itself propagates.
    """
    engine = state.engine
    if engine.draining:
        return "shutting down"
    try:
        await engine.check_shards()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return "shards unhealthy: the shard group is restarting"
    except Exception as error:
        logger.warning("health check failed: {}", error)
        plain = getattr(error, "public_message", "the model shards did not answer")
        return f"shards unhealthy: {plain}"
    if not engine.healthy:
        return "the last generation step failed"
    return None
