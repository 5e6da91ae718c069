"""The router's step trace is its own (not the shard's): off unless given a folder, and
handed to the shard client and the engine's calls in flight."""

from __future__ import annotations

import os
from pathlib import Path

from router.engine.inflight import InFlightSteps
from router.metrics import Metrics
from router.shard_client import ShardClient
from router.step_trace import NullTrace, StepTrace, step_trace


def test_no_folder_is_a_null_trace(tmp_path: Path) -> None:
    trace = step_trace("")
    assert isinstance(trace, NullTrace) and not trace.enabled
    trace.mark("send", 1, 4)
    trace.flush()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_gets_this_process_rows(tmp_path: Path) -> None:
    trace = step_trace(str(tmp_path))
    assert isinstance(trace, StepTrace)
    trace.mark("send", 2, 4)
    trace.mark("recv", 2)
    trace.flush()
    trace.flush()  # nothing new: nothing appended
    lines = (tmp_path / f"{os.getpid()}.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in lines] == [["send", "2"], ["recv", "2"]]
    assert lines[0].split("\t")[3] == "4"


async def test_the_client_and_the_calls_in_flight_take_the_trace_given(tmp_path: Path) -> None:
    trace = step_trace(str(tmp_path))
    plain, traced = ShardClient(["127.0.0.1:1"]), ShardClient(["127.0.0.1:1"], trace=trace)
    try:
        assert isinstance(plain.trace, NullTrace)
        assert traced.trace is trace
    finally:
        await plain.close()
        await traced.close()
    assert InFlightSteps(Metrics(lambda: {}), trace).trace is trace
