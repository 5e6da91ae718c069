"""Programmatic dependent launch switches (shard/pdl.py): launch options per device, the
shard's ``--pdl off`` (and the runner applying it) and the ``pdl_disabled`` context. The
wrappers' launch options, and each kernel's PTX waiting before it touches memory, are
checked by tests/kernels/test_sm90_compile.py; the launches themselves run on an sm_90
GPU (tests/kernels/test_cuda_graphs.py: bit-equal logits with and without)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pdl = pytest.importorskip("shard.pdl")

ON = {"USE_PDL": True, "launch_pdl": True}
OFF = {"USE_PDL": False}


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """GPU 0 supports PDL, GPU 1 does not; the process-wide switches start cleared and
    are restored afterwards."""
    monkeypatch.setattr(pdl, "_supported", lambda index: index == 0)
    monkeypatch.setattr(pdl, "_off", 0)
    monkeypatch.setattr(pdl, "_configured_off", False)
    monkeypatch.setattr(pdl, "_interpreted", lambda: False)
    return torch.device("cuda", 0)


def test_launch_options_follow_the_switches(sm90: torch.device) -> None:
    assert pdl.launch_options(sm90) == ON
    assert pdl.launch_options(torch.device("cuda", 1)) == OFF
    assert pdl.launch_options(torch.device("cpu")) == OFF
    with pdl.pdl_disabled():
        with pdl.pdl_disabled():
            assert pdl.launch_options(sm90) == OFF
        assert pdl.launch_options(sm90) == OFF  # still inside the outer context
    assert pdl.launch_options(sm90) == ON
    pdl.configure("off", sm90)
    assert pdl.launch_options(sm90) == OFF
    pdl.configure("auto", sm90)
    assert pdl.launch_options(sm90) == ON


def test_no_pdl_in_the_interpreter(sm90: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_interpreted", lambda: True)
    assert pdl.launch_options(sm90) == OFF


def test_the_runner_applies_its_pdl_flag(sm90: torch.device, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from shard import model_runner
    from shard.config import ShardConfig
    from tests.unit.shard.helpers import make_hf_model

    model_runner.configure_pdl("off", sm90, None)
    assert pdl.launch_options(sm90) == OFF
    model_runner.configure_pdl("auto", torch.device("cpu"), None)  # no CUDA: left as is
    assert pdl.launch_options(sm90) == OFF
    model_runner.configure_pdl("auto", sm90, None)
    assert pdl.launch_options(sm90) == ON

    calls = []
    monkeypatch.setattr(model_runner, "configure_pdl",
                        lambda mode, device, log: calls.append((mode, device.type)))
    make_hf_model("llama", tmp_path)
    model_runner.ModelRunner(ShardConfig(model_path=str(tmp_path), device="cpu", pdl="off"))
    assert calls == [("off", "cpu")]
