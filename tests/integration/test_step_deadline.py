"""A shard whose step hangs (its forward blocks) fails the step after the adaptive
deadline, not after minutes, and marks the group hung for the launcher to restart."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.config import SchedulerConfig
from router.engine.loop import Engine
from router.request import ErrorEvent, GenerationRequest, SamplingParams, StoppingParams
from router.shard_client import ShardClient
from router.step_deadline import StepDeadline
from router.tokenizer import Tokenizer


@pytest.fixture
async def hanging_shard(tiny_model_dir: Path) -> AsyncIterator[tuple[str, threading.Event]]:
    """A real tiny shard whose decode step blocks from its 5th launch until the event is
    set."""
    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner
    from shard.server import start_server

    config = ShardConfig(model_path=str(tiny_model_dir), dtype="float32", device="cpu",
                         kv_cache_bytes=8 * 1024 * 1024)
    server, port = await start_server(config, host="127.0.0.1", port=0)
    release = threading.Event()

    original = ModelRunner.launch_decode
    calls = 0

    def launch_decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls >= 5:
            release.wait()
        return original(self, *args, **kwargs)

    ModelRunner.launch_decode = launch_decode  # type: ignore[method-assign]
    try:
        yield f"127.0.0.1:{port}", release
    finally:
        ModelRunner.launch_decode = original  # type: ignore[method-assign]
        release.set()
        await server.stop(grace=None)


async def test_hung_step_fails_after_the_adaptive_deadline(
    hanging_shard: tuple[str, threading.Event], tiny_model_dir: Path
) -> None:
    address, _ = hanging_shard
    client = ShardClient([address], StepDeadline(floor_s=1.0, factor=10.0))
    await client.wait_ready(30)
    num_blocks = await client.warmup(64, 256)
    info = (await client.info())[0]
    config = SchedulerConfig(max_batch_prefill_tokens=64, max_input_tokens=32,
                             max_total_tokens=256)
    engine = Engine(client, Tokenizer.from_folder(tiny_model_dir), config, num_blocks,
                    info.block_size)
    engine.start()
    request = GenerationRequest(
        input_ids=tuple(engine.tokenizer.encode("Hello there")), sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=50, ignore_eos=True),
    )
    try:
        started = time.monotonic()
        events = [event async for event in engine.generate(request)]
        elapsed = time.monotonic() - started
    finally:
        await engine.stop()
        await client.close()
    # Prefill + 4 decodes, then the 5th decode hangs until the deadline.
    assert [isinstance(e, ErrorEvent) for e in events] == [False] * 5 + [True]
    error = events[-1]
    assert isinstance(error, ErrorEvent)
    # the client reads plain words; the gRPC detail (DEADLINE_EXCEEDED) goes to the log
    assert "did not answer in time" in error.message
    assert client.hung_rank == 0
    # Steps of milliseconds: the deadline is the 1 s floor or a few times a fast Warmup,
    # far below the minutes a fixed deadline allowed.
    assert elapsed < 10 * max(1.0, client.deadline.seconds)
