"""The fused gate/up + SwiGLU kernel against its reference: ``F.linear`` then
:func:`shard.layers.fused.silu_and_mul`.

CPU: Triton's interpreter, float16 only (its bfloat16 ``tl.dot`` is not exact); GPU:
compiled, float16 and bfloat16, and a bfloat16 model's logits with the kernel against
without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from shard.kernels.gate_up_silu import (
    MAX_ROWS,
    MIN_ROWS,
    GateUpConfig,
    default_config,
    gate_up_silu,
)
from shard.layers import fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (rows, intermediate N, in_features K, config): rows past a tile and not, K tiled evenly
# and not, N past a tile
SHAPES = [(MIN_ROWS, 80, 96, GateUpConfig(16, 32, 32, 4, 2)),
          (16, 48, 64, GateUpConfig(16, 16, 32, 4, 3)),
          (40, 48, 64, GateUpConfig(32, 16, 64, 4, 3)),
          (33, 64, 100, GateUpConfig(16, 64, 32, 4, 2))]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused path in float32 products rounded as the kernel rounds them: each
    projection to x's dtype, then SwiGLU as the layer computes it."""
    gate_up = F.linear(x.float(), weight.float()).to(x.dtype)
    return fused.silu_and_mul.eager(gate_up.cpu()).to(x.device)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "config"), SHAPES)
def test_gate_up_silu(m: int, n: int, k: int, config: GateUpConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(2 * n, k, generator=gen) * 0.2).to(dtype).to(DEVICE)
    got = gate_up_silu(x, weight, config)
    assert got is not None and got.dtype == dtype and got.shape == (m, n)
    want = _reference(x, weight)
    # the products differ from the reference by float32 summation order, which can move
    # a rounding of gate or up by one unit of the dtype
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * ulp,
                               atol=4 * ulp * want.float().abs().max().item())


def test_gate_up_silu_strided_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2 * MIN_ROWS, 64, generator=gen).half().to(DEVICE)[::2]
    weight = (torch.randn(64, 64, generator=gen) * 0.2).half().to(DEVICE)
    assert x.stride(0) == 128
    got = gate_up_silu(x, weight, GateUpConfig(16, 32, 32, 4, 2))
    assert got is not None
    torch.testing.assert_close(got.float(), _reference(x, weight).float(), rtol=4e-3, atol=4e-3)


def test_gate_up_kernel_declines_what_it_does_not_take() -> None:
    # None sends the layer to the reference: never a wrong or partial result
    weight = torch.randn(64, 32).half().to(DEVICE)
    x = torch.randn(4, 32).half().to(DEVICE)
    assert gate_up_silu(x, weight, GateUpConfig(16, 16, 32, 4, 2)) is not None
    assert gate_up_silu(x[:0], weight) is None  # no rows
    assert gate_up_silu(torch.randn(MAX_ROWS + 1, 32).half().to(DEVICE), weight) is None
    assert gate_up_silu(x.float(), weight.float()) is None  # float32: cuBLAS, exact
    assert gate_up_silu(x, weight.bfloat16()) is None  # mixed dtypes
    assert gate_up_silu(x, weight[:, :16]) is None  # in_features differ
    assert gate_up_silu(x, weight[:63]) is None  # no gate/up halves
    assert gate_up_silu(x.t().contiguous().t(), weight) is None  # columns strided
    with torch.enable_grad():  # autograd would record the product: the reference's to do
        assert gate_up_silu(x.clone().requires_grad_(), weight) is None


def test_default_config_by_rows() -> None:
    assert default_config(MIN_ROWS) == default_config(16) == GateUpConfig(16, 32, 256, 4, 3)
    assert default_config(17).block_m == 64
    assert default_config(MAX_ROWS).block_m == 128
    assert default_config(64) == GateUpConfig(64, 64, 128, 4, 4)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [3, 24])  # one 16-row tile; past it
def test_model_logits_with_and_without_the_fused_mlp_bf16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    import gc

    from shard.config import ShardConfig
    from shard.decode_state import DecodeRows
    from shard.kernels import gate_up_silu as kernel_module
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import make_hf_model

    launches: list[int] = []  # rows of each product the kernel took
    launch = kernel_module.gate_up_silu

    def counted(x: torch.Tensor, weight: torch.Tensor, *, pdl: bool) -> torch.Tensor | None:
        out = launch(x, weight, pdl=pdl)
        if out is not None:
            launches.append(x.shape[0])
        return out

    make_hf_model("llama", tmp_path)
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device="cuda",
                                     dtype="bfloat16", block_size=4, attention_backend="triton",
                                     cuda_graphs="0", gpu_memory_fraction=0.2))
    monkeypatch.setattr(runner.kernels, "gate_up_silu", counted)
    try:
        runner.warmup(max_batch_prefill_tokens=256, max_total_tokens=512, max_batch_size=32)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 100, (rows,), generator=generator).tolist()
        lens = torch.randint(1, 30, (rows,), generator=generator).tolist()
        tables = [[1 + 8 * i + j for j in range(-(-(n + 1) // 4))] for i, n in enumerate(lens)]
        inputs = DecodeRows.build(tokens, lens, tables, torch.device("cuda")).model_inputs(
            runner.block_size, 31)
        with torch.inference_mode():
            launches.clear()  # warm-up's prefills took it too
            got = runner.model.compute_logits(runner.forward(inputs))
            layers = runner.model.config.num_hidden_layers  # type: ignore[attr-defined]
            assert launches == [rows] * layers
            with runner.kernels.disabled("gate_up_silu"):
                want = runner.model.compute_logits(runner.forward(inputs))
            assert len(launches) == layers  # none without the kernel
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    err = ((got - want).norm() / want.norm()).item()
    print(f"\nGPU-CHECK fused gate/up vs cuBLAS + silu_mul bf16 logits rel_err={err:.2e}")
    assert err < 5e-3
