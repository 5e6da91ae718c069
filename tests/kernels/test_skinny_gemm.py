"""The skinny GEMM kernel (a few rows times a weight) against its reference, ``F.linear``;
its fp8 product against ``torch._scaled_mm``.

CPU: Triton's interpreter, float16 only (its bfloat16 ``tl.dot`` is not exact); GPU:
compiled, float16 and bfloat16, and a bfloat16 model's logits with the kernel against
without it. The fp8 product sums the same exact products of e4m3 values in float32 as
``torch._scaled_mm`` in another order: within 1e-5 of the output's largest value (float32
output), or one step of the output's rounding (bfloat16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from shard.kernels.skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    default_config,
    skinny_fp8_linear,
    skinny_linear,
)
from shard.quantization.fp8 import fp8_linear, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (rows, out_features N, in_features K, config): K tiled evenly and not, N past a tile,
# one row and a full tile of rows
SHAPES = [(1, 96, 256, None), (3, 100, 200, SkinnyConfig(32, 64, 4, 2)),
          (MAX_ROWS, 64, 512, SkinnyConfig(16, 128, 4, 3)), (5, 48, 24, None)]


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0
          ) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _assert_product_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
    """``got`` against the float32 product of the same (rounded) inputs: the kernel
    accumulates in float32 too, so they differ by the output's rounding."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    ulp = 2**-7 if x.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want, rtol=ulp, atol=ulp * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "config"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear(m: int, n: int, k: int, config: SkinnyConfig | None, with_bias: bool,
                       dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x, weight = _rand(gen, m, k, dtype=dtype), _rand(gen, n, k, dtype=dtype, scale=0.05)
    bias = _rand(gen, n, dtype=dtype) if with_bias else None
    got = skinny_linear(x, weight, bias, config)
    assert got is not None
    _assert_product_close(got, x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_linear_strided(dtype: torch.dtype) -> None:
    # rows of x and of the weight further apart than K: every other row of x, and a
    # column slice of a wider weight
    gen = torch.Generator().manual_seed(3)
    x = _rand(gen, 6, 200, dtype=dtype)[::2]
    weight = _rand(gen, 40, 300, dtype=dtype, scale=0.05)[:, 50:250]
    assert x.stride(0) == 400 and weight.stride(0) == 300
    got = skinny_linear(x, weight, None, SkinnyConfig(16, 64, 4, 2))
    assert got is not None
    _assert_product_close(got, x, weight, None)


def test_skinny_kernel_declines_what_it_does_not_take() -> None:
    # None sends the layer to the reference: never a wrong or partial result
    x, weight = torch.randn(2, 64).half().to(DEVICE), torch.randn(32, 64).half().to(DEVICE)
    assert skinny_linear(x, weight) is not None
    assert skinny_linear(torch.randn(MAX_ROWS + 1, 64).half().to(DEVICE), weight) is None
    assert skinny_linear(x[:0], weight) is None  # no rows
    assert skinny_linear(x.float(), weight.float()) is None  # float32: cuBLAS, exact
    assert skinny_linear(x, weight.bfloat16()) is None  # mixed dtypes
    assert skinny_linear(x, weight[:, :32]) is None  # in_features differ
    assert skinny_linear(x.t().contiguous().t(), weight) is None  # transposed: columns strided
    assert skinny_linear(x, weight, torch.zeros(32).float().to(DEVICE)) is None  # bias dtype
    assert skinny_linear(x, weight, torch.zeros(1).half().to(DEVICE)) is None  # bias shape
    with torch.enable_grad():  # autograd would record the product: F.linear's to do
        assert skinny_linear(x.clone().requires_grad_(), weight) is None


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
               w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                            out_dtype=out_dtype)


@pytest.mark.parametrize(("m", "n", "k", "config"), SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_skinny_fp8_linear_equals_scaled_mm(m: int, n: int, k: int,
                                            config: SkinnyConfig | None,
                                            out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    # rows of very different magnitudes: the scales carry them
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, n)[:, None]
    (x_q, x_scale), (w_q, w_scale) = quantize_rows(x.to(DEVICE)), quantize_rows(w.to(DEVICE))
    got = skinny_fp8_linear(x_q, x_scale, w_q, w_scale, out_dtype, config)
    assert got is not None and got.dtype == out_dtype and got.shape == (m, n)
    # the reference in float32 on the CPU (where torch._scaled_mm runs every shape)
    want = _scaled_mm(x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), torch.float32)
    tol = 1e-5 if out_dtype == torch.float32 else 2**-7  # the interpreter truncates
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=1e-5 * want.abs().max())


def test_skinny_fp8_linear_declines_what_it_does_not_take() -> None:
    x_q, x_scale = quantize_rows(torch.randn(2, 64, device=DEVICE))
    w_q, w_scale = quantize_rows(torch.randn(32, 64, device=DEVICE))
    assert skinny_fp8_linear(x_q, x_scale, w_q, w_scale) is not None
    big_q, big_scale = quantize_rows(torch.randn(MAX_ROWS + 1, 64, device=DEVICE))
    assert skinny_fp8_linear(big_q, big_scale, w_q, w_scale) is None
    assert skinny_fp8_linear(x_q.float(), x_scale, w_q, w_scale) is None  # unquantized x
    assert skinny_fp8_linear(x_q, x_scale, w_q.to(torch.float8_e5m2), w_scale) is None
    assert skinny_fp8_linear(x_q, x_scale[:1], w_q, w_scale) is None  # a scale per row
    assert skinny_fp8_linear(x_q, x_scale, w_q, w_scale[:16]) is None  # per channel
    assert skinny_fp8_linear(x_q, x_scale, w_q, w_scale.double()) is None
    assert skinny_fp8_linear(x_q, x_scale, w_q[:, :32], w_scale) is None  # in_features
    assert skinny_fp8_linear(x_q, x_scale, w_q, w_scale, torch.float64) is None


def test_fp8_linear_runs_the_few_rows_kernel_and_falls_back() -> None:
    """fp8_linear hands its quantized rows to ``few_rows`` first, and runs
    ``torch._scaled_mm`` where that declines: the same product either way."""
    x = torch.randn(3, 64, device=DEVICE)
    w_q, w_scale = quantize_rows(torch.randn(32, 64, device=DEVICE))
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor | None:
        calls.append(1)
        return skinny_fp8_linear(*args)  # type: ignore[arg-type]

    through_kernel = fp8_linear(x, w_q, w_scale, few_rows=counted)
    declined = fp8_linear(x, w_q, w_scale, few_rows=lambda *args: None)
    assert len(calls) == 1
    # the CPU writes float32; CUDA bfloat16, and Hopper's fp8 tensor cores sum in fewer
    # bits than the kernel: a bfloat16 step apart
    tol = 1e-5 if DEVICE == "cpu" else 2**-7
    torch.testing.assert_close(through_kernel, declined, rtol=tol, atol=tol)
    assert through_kernel.dtype == declined.dtype


def test_default_config_fits_small_problems() -> None:
    assert default_config(4096, 4096) == SkinnyConfig(32, 512, 4, 4)
    assert default_config(6144, 4096).block_n == 64
    small = default_config(20, 24)  # tiles capped to the problem (at least a 16 x 16 dot)
    assert (small.block_n, small.block_k) == (32, 32)
    assert default_config(8, 8)[:2] == (16, 16)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_model_logits_with_and_without_skinny_kernels_bf16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from shard.config import ShardConfig
    from shard.decode_state import DecodeRows
    from shard.kernels import skinny_gemm
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import make_hf_model

    launches: list[int] = []  # out_features of each product the kernel took
    launch = skinny_gemm.skinny_linear

    def counted(x: torch.Tensor, weight: torch.Tensor, *args: object,
                pdl: bool) -> torch.Tensor | None:
        out = launch(x, weight, *args, pdl=pdl)  # type: ignore[arg-type]
        if out is not None:  # the kernel took the product
            launches.append(weight.shape[0])
        return out

    make_hf_model("llama", tmp_path)
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device="cuda",
                                     dtype="bfloat16", block_size=4, attention_backend="triton",
                                     cuda_graphs="0", gpu_memory_fraction=0.2))
    monkeypatch.setattr(runner.kernels, "skinny_linear", counted)
    try:
        runner.warmup(max_batch_prefill_tokens=256, max_total_tokens=512, max_batch_size=8)
        rows = DecodeRows.build([5, 9, 13], [7, 30, 2],
                                [[3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [1]], torch.device("cuda"))
        inputs = rows.model_inputs(runner.block_size, 31)
        with torch.inference_mode():
            launches.clear()
            got = runner.model.compute_logits(runner.forward(inputs))
            cfg = runner.model.config  # type: ignore[attr-defined]
            qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
            # gate/up runs through the fused gate/up + SwiGLU kernel, in both passes
            per_layer = [qkv, cfg.hidden_size, cfg.hidden_size]
            layers = cfg.num_hidden_layers
            assert launches == per_layer * layers + [cfg.vocab_size]  # and the LM head
            with runner.kernels.disabled("skinny_linear"):
                want = runner.model.compute_logits(runner.forward(inputs))
            assert len(launches) == 3 * layers + 1  # none without the kernels
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    err = ((got - want).norm() / want.norm()).item()
    print(f"\nGPU-CHECK skinny vs cuBLAS bf16 logits rel_err={err:.2e}")
    assert err < 5e-3  # float32 sums in another order, then bf16 logits
