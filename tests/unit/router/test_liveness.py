"""Liveness probes of the local executor: a rank is judged only once the group is known
to have started, and then one that does not answer is hung, even if its probe never
got an answer of its own (the rank stopped right after start-up)."""

from __future__ import annotations

from router.config import ShardLaunchConfig
from router.executors import HealthProbe, LocalExecutor, free_port


async def test_a_rank_silent_since_start_up_is_hung_once_the_group_is_ready() -> None:
    executor = LocalExecutor(ShardLaunchConfig(model_path="m", model_id="m"))
    # nothing listens there: the probe never gets an answer
    executor.probes = [HealthProbe(f"127.0.0.1:{free_port()}")]
    try:
        assert await executor.dead_rank() is None  # still loading, as far as it knows
        executor.mark_ready()
        assert await executor.dead_rank() == 0
    finally:
        for probe in executor.probes:
            await probe.close()
