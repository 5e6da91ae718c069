"""The shard's step trace is configured by ``--step-trace-dir`` alone (never by the
environment) and is a no-op object when off; the runner and the servicer share one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shard import step_trace
from shard.config import ShardConfig
from shard.config_flags import config_from_args


def test_off_by_default_even_with_the_old_environment_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEP_TRACE_DIR", str(tmp_path))
    trace = step_trace.from_config(ShardConfig(model_path="m"))
    assert isinstance(trace, step_trace.NullTrace) and not trace.enabled
    trace.mark("arrive", 3)
    trace.flush()
    assert list(tmp_path.iterdir()) == []


def test_the_flag_names_the_folder_of_one_file_per_process(tmp_path: Path) -> None:
    config, _, _ = config_from_args(
        ["--model", "m", "--step-trace-dir", str(tmp_path / "trace")], environ={})
    trace = step_trace.from_config(config)
    assert isinstance(trace, step_trace.StepTrace) and trace.enabled
    trace.mark("arrive", 7)
    trace.mark("answer", 7, 5000)
    trace.flush()
    rows = [line.split("\t") for line in
            (tmp_path / "trace" / f"{os.getpid()}.tsv").read_text().splitlines()]
    assert [(point, step, value) for point, step, _, value in rows] == [
        ("arrive", "7", "0"), ("answer", "7", "5000")]
    assert int(rows[0][2]) <= int(rows[1][2])  # monotonic ns


def test_the_runner_marks_each_read_step_and_shares_its_trace(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from shard.model_runner import ModelRunner
    from shard.servicer import ShardServicer
    from tests.unit.shard.helpers import BLOCK_SIZE, DEVICE, prefill, request

    runner = ModelRunner(ShardConfig(model_path=str(llama[0]), device=DEVICE, dtype="float32",
                                     block_size=BLOCK_SIZE, kv_cache_bytes=2 << 20,
                                     step_trace_dir=str(tmp_path)))
    runner.warmup(64, 64, 4)
    assert runner.chain.trace is runner.trace
    assert ShardServicer(runner).trace is runner.trace  # one file per process
    prefill(runner, request(1, [5, 6, 7], [0]))
    runner.decode()
    runner.trace.flush()
    points = [line.split("\t")[:2] for line in
              (tmp_path / f"{os.getpid()}.tsv").read_text().splitlines()]
    assert points == [["ready", "-1"], ["ready", "-1"]]  # no device gap off CUDA
