"""Programmatic dependent launch switches (shard/pdl.py): launch options per device, the
shard's ``--pdl off`` and the ``pdl_disabled`` context. The launches themselves are
checked on an sm_90 GPU (tests/kernels/test_cuda_graphs.py: bit-equal logits with and
without) and compiled for sm_90 here (tests/kernels/test_sm90_compile.py)."""

from __future__ import annotations

import pytest
import torch

pdl = pytest.importorskip("shard.pdl")


def test_launch_options_follow_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_supported", lambda index: index == 0)  # an sm_90 GPU 0
    gpu, older = torch.device("cuda", 0), torch.device("cuda", 1)
    on = {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(gpu) == on
    assert pdl.launch_options(older) == {"USE_PDL": False}
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    with pdl.pdl_disabled():
        with pdl.pdl_disabled():
            assert not pdl.enabled(gpu)
        assert not pdl.enabled(gpu)  # still inside the outer context
    assert pdl.launch_options(gpu) == on
    try:
        pdl.configure("off", gpu)
        assert pdl.launch_options(gpu) == {"USE_PDL": False}
        pdl.configure("auto", gpu)
        assert pdl.launch_options(gpu) == on
    finally:
        pdl.configure("auto", gpu)


def test_no_pdl_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pdl._supported.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert not pdl._supported(0)  # decided before any CUDA query
    finally:
        pdl._supported.cache_clear()
