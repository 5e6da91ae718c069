"""Backend selection: ``auto`` falls back flash_attn → flashinfer → triton → torch,
saying why each was skipped; an explicit backend that cannot run is a start-up error;
a backend's block size requirement reaches ``Info``."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from shard.attention import ATTENTION_BACKENDS, AttentionSpec, get_backend_class, select_backend
from shard.attention.flash_attn_backend import FlashAttnBackend
from shard.attention.flashinfer_backend import FlashInferBackend
from shard.attention.triton_backend import TritonAttentionBackend

CPU = AttentionSpec(torch.device("cpu"), torch.float32, 8, 2, 64, 16)
CUDA_BF16 = AttentionSpec(torch.device("cuda"), torch.bfloat16, 64, 8, 128, 16)


@pytest.fixture
def no_optional_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make flash_attn, flashinfer and triton fail to import."""
    for name in ("triton", "flash_attn", "flashinfer"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flash_attn 2.8.3 that imports, on a pretend sm90 GPU."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_auto_order_and_names() -> None:
    assert list(ATTENTION_BACKENDS) == ["triton", "flash_attn", "flashinfer", "torch"]
    with pytest.raises(ValueError, match="valid: auto, triton, flash_attn, flashinfer, torch"):
        get_backend_class("flash")


def test_auto_falls_back_to_torch_and_says_why(no_optional_packages: None) -> None:
    backend, reason = select_backend("auto", CUDA_BF16)
    assert backend.name == "torch"
    for name in ("triton", "flash_attn", "flashinfer"):
        assert f"{name} skipped: {name} is not importable" in reason
    assert reason.endswith("auto chose torch: pure PyTorch reference backend: runs on any "
                           "device and dtype")


def test_auto_on_cpu_skips_gpu_backends() -> None:
    backend, reason = select_backend("auto", CPU)
    assert backend.name == "torch"
    if "triton skipped: needs a CUDA device" not in reason:
        assert "triton skipped: triton is not importable" in reason


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer", "triton"])
def test_explicit_backend_that_cannot_run_is_an_error(
    no_optional_packages: None, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"attention backend '{name}' cannot run this model: "
                                         rf"{name} is not importable"):
        select_backend(name, CUDA_BF16)


def test_explicit_triton_on_cpu_is_an_error() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="'triton' cannot run this model: needs a CUDA device"):
        select_backend("triton", CPU)


def test_triton_chosen_first_on_cuda(fake_flash_attn: None) -> None:
    pytest.importorskip("triton")
    backend, reason = select_backend("auto", CUDA_BF16)
    assert isinstance(backend, TritonAttentionBackend) and backend.cuda_graph_safe
    assert reason.startswith("auto chose triton")


def test_flash_attn_next_with_block_size_raised(
    fake_flash_attn: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    backend, reason = select_backend("auto", CUDA_BF16)
    assert reason.startswith("triton skipped: triton is not importable")
    assert isinstance(backend, FlashAttnBackend)
    assert "flash_attn 2.8.3" in reason and "block size 16 raised to 256" in reason
    assert backend.kv_block_size(16) == 256 and backend.kv_block_size(512) == 512


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (AttentionSpec(torch.device("cuda"), torch.float32, 8, 2, 64, 16), "float16/bfloat16"),
        (AttentionSpec(torch.device("cuda"), torch.bfloat16, 8, 2, 60, 16), "multiple of 8"),
        (AttentionSpec(torch.device("cuda"), torch.bfloat16, 8, 2, 512, 16), "up to 256"),
    ],
)
def test_flash_attn_unsupported_models_fall_through(
    fake_flash_attn: None, monkeypatch: pytest.MonkeyPatch, spec: AttentionSpec, why: str
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    backend, reason = select_backend("auto", spec)
    flash_attn_part = next(p for p in reason.split("; ") if p.startswith("flash_attn skipped"))
    assert backend.name == "torch" and why in flash_attn_part


def test_old_flash_attn_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.3.6"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    ok, reason = FlashAttnBackend.supports(CUDA_BF16)
    assert not ok and "2.3.6 < 2.5" in reason


def test_a_probe_that_raises_is_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(spec: AttentionSpec) -> tuple[bool, str]:
        raise RuntimeError("CUDA driver too old")

    monkeypatch.setattr(FlashInferBackend, "supports", classmethod(lambda c, s: broken(s)))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    backend, reason = select_backend("auto", CPU)
    assert backend.name == "torch"
    assert "flashinfer skipped: probe failed: RuntimeError: CUDA driver too old" in reason


def test_triton_declares_any_block_size() -> None:
    assert TritonAttentionBackend.kv_block_size(16) == 16
    assert TritonAttentionBackend.kv_block_size(5) == 5


def test_info_reports_the_backend_block_size(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The runner asks the backend for its block size; Info and Warmup report it, and the
    router builds its block manager from Info's block size (router/launcher.py)."""
    from shard.config import ShardConfig
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    # flash_attn "runs" on this CPU for the test: only selection and sizing are checked.
    # NOTE: no fake module in sys.modules here: transformers probes flash_attn's spec.
    monkeypatch.setattr(FlashAttnBackend, "supports", classmethod(lambda c, s: (True, "fake")))
    monkeypatch.setattr(FlashAttnBackend, "__init__", lambda self, kernels=None: None)
    config = ShardConfig(
        model_path=str(tmp_path), device="cpu", dtype="float32", block_size=16,
        attention_backend="flash_attn",
    )
    runner = ModelRunner(config)
    info = runner.info()
    assert (info.attention_backend, info.block_size) == ("flash_attn", 256)
    assert "raised to 256" in info.attention_backend_reason
    torch_runner = ModelRunner(
        ShardConfig(
            model_path=str(tmp_path), device="cpu", dtype="float32", block_size=16,
            attention_backend="torch",
        )
    )
    assert torch_runner.info().block_size == 16


@pytest.mark.parametrize("name", ["torch", "triton", "auto"])
def test_query_heads_not_a_multiple_of_kv_heads_is_rejected(name: str) -> None:
    uneven = AttentionSpec(torch.device("cpu"), torch.float32, 9, 2, 64, 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        select_backend(name, uneven)
