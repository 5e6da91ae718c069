"""The health ``Watch`` of ``shardserve serve`` without a Ray cluster: which statuses a
stream sends and when it ends (through Ray Serve's gRPC proxy:
tests/e2e/test_serve_replicas.py)."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health_pb2

from router.serve import health_watch
from router.serve.health_watch import StopSign, watch_statuses

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_stream_sends_each_change_once_and_ends_when_stopping() -> None:
    answers = [
        (SERVING, ""),
        (SERVING, ""),
        (NOT_SERVING, "lost"),
        (NOT_SERVING, "lost"),
        (SERVING, ""),
        (SERVING, ""),
    ]
    probes = 0

    async def probe() -> tuple[int, str]:
        nonlocal probes
        probes += 1
        return answers[probes - 1]

    async def stopping() -> bool:
        return probes == len(answers)

    sent = [status async for status in watch_statuses(probe, stopping, period_s=0.0)]
    assert sent == [SERVING, NOT_SERVING, SERVING]
    assert probes == len(answers)


async def test_a_stream_of_a_stopping_ingress_sends_nothing() -> None:
    async def probe() -> tuple[int, str]:
        raise AssertionError("no probe once stopping")

    async def stopping() -> bool:
        return True

    assert [s async for s in watch_statuses(probe, stopping, period_s=0.0)] == []


async def test_the_stop_sign_asks_once_per_period_and_keeps_its_answer_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[str, str, str]] = []
    answers: list[bool | Exception] = [False, RuntimeError("controller restarting"), True]

    def replica_stopping(app_name: str, deployment: str, replica_id: str) -> bool:
        asked.append((app_name, deployment, replica_id))
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(health_watch, "replica_stopping", replica_stopping)
    sign = StopSign("app", "Ingress", "r1", period_s=3600.0)
    assert await asyncio.gather(*(sign.stopping() for _ in range(8))) == [False] * 8
    assert asked == [("app", "Ingress", "r1")]
    sign.period_s = 0.0
    assert await sign.stopping() is False  # the failed ask keeps the last answer
    assert await sign.stopping() is True
    assert len(asked) == 3
