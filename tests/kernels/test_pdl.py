"""Programmatic dependent launch (shard/kernels/pdl.py): launch options per device and
per the caller's choice, and that choice held by the runner's KernelChoices from its
``--pdl`` flag (never a process-wide switch). The wrappers' launch options, and each
kernel's PTX waiting before it touches memory, are checked by
tests/kernels/test_sm90_compile.py; the launches themselves run on an sm_90 GPU
(tests/kernels/test_cuda_graphs.py: bit-equal logits with and without)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shard.kernels.choices import KernelChoices

pdl = pytest.importorskip("shard.kernels.pdl")

ON = {"USE_PDL": True, "launch_pdl": True}
OFF = {"USE_PDL": False}


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """GPU 0 supports PDL, GPU 1 does not, kernels are compiled (not interpreted)."""
    monkeypatch.setattr(pdl, "_supported", lambda index: index == 0)
    monkeypatch.setattr(pdl, "_interpreted", lambda: False)
    return torch.device("cuda", 0)


def test_launch_options_follow_the_choice_and_the_device(sm90: torch.device) -> None:
    assert pdl.launch_options(sm90, True) == ON
    assert pdl.launch_options(sm90, False) == OFF
    assert pdl.launch_options(torch.device("cuda", 1), True) == OFF
    assert pdl.launch_options(torch.device("cpu"), True) == OFF


def test_no_pdl_in_the_interpreter(sm90: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_interpreted", lambda: True)
    assert pdl.launch_options(sm90, True) == OFF


def test_the_choices_follow_the_flag(sm90: torch.device) -> None:
    assert KernelChoices.load(sm90, "auto").pdl
    assert not KernelChoices.load(sm90, "off").pdl
    assert not KernelChoices.load(torch.device("cuda", 1), "auto").pdl  # not supported
    assert not KernelChoices.load(torch.device("cpu"), "auto").pdl
    with KernelChoices.load(sm90, "auto").disabled("greedy"):  # kernels, not PDL
        pass
    with pytest.raises(ValueError, match="valid: skinny_linear"):
        with KernelChoices().disabled("pdl"):
            pass


def test_the_runner_holds_the_choices_of_its_flag(tmp_path: Path) -> None:
    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device="cpu", pdl="auto"))
    assert not runner.kernels.pdl and runner.kernels.skinny_linear is None  # CPU: none
    assert runner.backend.kernels is runner.kernels
    layers = [m for m in runner.model.modules() if hasattr(m, "kernels")]
    assert layers and all(m.kernels is runner.kernels for m in layers)
