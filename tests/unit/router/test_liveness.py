"""Liveness probes of the local executor: a rank is judged only once the group is known
to have started, and then one that does not answer is hung, even if its probe never
got an answer of its own (the rank stopped right after start-up); a rank that started
listening late, after its probe had been refused, is not."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest

from router.executors import HealthProbe, LocalExecutor
from shard.config import ShardConfig
from shard.config_flags import config_from_args
from shard.pb import shard_pb2, shard_pb2_grpc
from tests.ports import unused_port


class AlwaysHealthy(shard_pb2_grpc.ShardServiceServicer):
    async def Health(self, request: shard_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> shard_pb2.HealthResponse:
        return shard_pb2.HealthResponse()


async def test_a_rank_silent_since_start_up_is_hung_once_the_group_is_ready() -> None:
    executor = LocalExecutor(ShardConfig(model_path="m", model_id="m"))
    # nothing listens there: the probe never gets an answer
    executor.probes = [HealthProbe(f"127.0.0.1:{unused_port()}", timeout_s=0.5)]
    try:
        assert await executor.dead_rank() is None  # still loading, as far as it knows
        executor.mark_ready()
        assert await executor.dead_rank() == 0
    finally:
        for probe in executor.probes:
            await probe.close()


async def test_a_rank_that_listens_after_refused_probes_is_not_hung() -> None:
    executor = LocalExecutor(ShardConfig(model_path="m", model_id="m"))
    port = unused_port()
    probe = HealthProbe(f"127.0.0.1:{port}", timeout_s=0.3)
    executor.probes = [probe]
    server = grpc.aio.server()
    try:
        # The rank is still loading: connections are refused, the channel backs off.
        for _ in range(4):
            assert await executor.dead_rank() is None
        probe.timeout_s = 3.0
        shard_pb2_grpc.add_ShardServiceServicer_to_server(AlwaysHealthy(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        executor.mark_ready()
        assert await executor.dead_rank() is None
    finally:
        await server.stop(None)
        for probe in executor.probes:
            await probe.close()


async def test_local_shards_are_told_to_stop_with_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each rank gets this process's pid as --parent-pid (tests/integration/
    # test_parent_watch.py shows a shard stopping once that process is killed)
    started: list[list[str]] = []

    class Recorded:
        def __init__(self, argv: list[str], **_: object) -> None:
            started.append(argv)
            self.pid = 0

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    executor = LocalExecutor(ShardConfig(model_path="m", model_id="m", world_size=2))
    await executor.start()
    try:
        assert len(started) == 2
        for argv in started:
            parsed, _, _ = config_from_args(argv[3:], environ={})
            assert parsed.parent_pid == os.getpid()
    finally:
        for probe in executor.probes:
            await probe.close()
