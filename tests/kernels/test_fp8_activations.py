"""The kernels that write activations quantized per token for an fp8 product (RMSNorm
with or without the residual add, SwiGLU's ``silu(gate) * up``) against their
references, the unfused op then :func:`shard.quantization.fp8.quantize_rows`; and a
tiny model with fp8 weights run with them against without them.

CPU: Triton's interpreter; GPU: compiled. Tolerances: every e4m3 value equal to the
reference's or one e4m3 step from it (summation order or ``exp`` may move a rounding of
the row to its dtype by an ulp, and with it the quantized value), at least 99% of them
equal; scales equal within 1e-6 relative (float32 rounding of the row's amax); the sum
of the residual add exact (one rounded add)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from shard.kernels.rms_norm import add_rms_norm_fp8
from shard.kernels.silu_mul import MAX_FP8_D, silu_and_mul_fp8
from shard.layers import fused
from shard.quantization.fp8 import FP8_DTYPE, MIN_SCALE, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]
quantize_ref = quantize_rows.eager  # type: ignore[attr-defined]


def _e4m3_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many e4m3 values apart each pair of elements is (0: equal; +0 and -0 too)."""

    def ordinal(q: torch.Tensor) -> torch.Tensor:
        bits = q.view(torch.uint8).to(torch.int16)
        magnitude = bits & 0x7F
        return torch.where(bits >= 0x80, -magnitude, magnitude)

    return (ordinal(got) - ordinal(want)).abs()


def _check_quantized(
    q: torch.Tensor, scale: torch.Tensor, ref_q: torch.Tensor, ref_scale: torch.Tensor
) -> None:
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    steps = _e4m3_steps(q.cpu(), ref_q.cpu())
    assert int(steps.max()) <= 1, f"{int(steps.max())} e4m3 steps from the reference"
    equal = float((steps == 0).float().mean())
    assert equal >= 0.99, f"only {equal:.2%} of the values equal the reference's"


def _rows(
    num_tokens: int, width: int, dtype: torch.dtype, seed: int, top: float = 2
) -> torch.Tensor:
    """Random rows whose standard deviations span 10^-3 to 10^top, in random order."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-3, top, num_tokens)[torch.randperm(num_tokens, generator=gen)]
    return (torch.randn(num_tokens, width, generator=gen) * magnitude[:, None]).to(dtype)


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (5, 1000), (300, 256), (64, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_fp8_matches_norm_then_quantize_rows(
    num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool
) -> None:
    x = _rows(num_tokens, hidden, dtype, hidden + num_tokens).to(DEVICE)
    residual = _rows(num_tokens, hidden, dtype, hidden).to(DEVICE)
    gen = torch.Generator().manual_seed(num_tokens)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(DEVICE)
    result = add_rms_norm_fp8(x, residual if with_residual else None, weight, 1e-5)
    assert result is not None
    q, scale, total = result
    if with_residual:
        normed, want_total = fused.add_rms_norm.eager(x, residual, weight, 1e-5)  # type: ignore[attr-defined]
        assert total is not None and torch.equal(total, want_total)
    else:
        normed = fused.rms_norm.eager(x, weight, 1e-5)  # type: ignore[attr-defined]
        assert total is None
    _check_quantized(q, scale, *quantize_ref(normed))


@pytest.mark.parametrize(
    ("num_tokens", "d"), [(1, 64), (5, 1000), (300, 128), (8, 4096), (2, 14336)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_fp8_matches_silu_mul_then_quantize_rows(
    num_tokens: int, d: int, dtype: torch.dtype
) -> None:
    # gates up to ~40 (silu's exp overflows float32 beyond 88: harmless, but warned of)
    x = _rows(num_tokens, 2 * d, dtype, d + num_tokens, top=1).to(DEVICE)
    result = silu_and_mul_fp8(x)
    assert result is not None
    _check_quantized(*result, *quantize_ref(fused.silu_and_mul.eager(x)))  # type: ignore[attr-defined]


def test_rows_of_zeros_and_no_rows() -> None:
    zeros = torch.zeros(2, 128, device=DEVICE)
    for q, scale in (
        silu_and_mul_fp8(zeros),
        add_rms_norm_fp8(zeros[:, :64], None, torch.ones(64, device=DEVICE), 1e-5)[:2],
    ):  # type: ignore[index]
        assert not q.float().any() and torch.equal(scale.cpu(), torch.full((2,), MIN_SCALE))
    q, scale = silu_and_mul_fp8(zeros[:0])  # type: ignore[misc]
    assert q.shape == (0, 64) and scale.shape == (0,)


def test_fp8_kernels_decline_rows_they_do_not_take() -> None:
    # None sends the layer to the unfused path: never a wrong or partial result
    x = torch.randn(3, 64).to(DEVICE)
    weight = torch.ones(64).to(DEVICE)
    assert add_rms_norm_fp8(x.view(3, 8, 8), None, weight[:8], 1e-5) is None  # per-head
    assert add_rms_norm_fp8(x, None, weight.to(torch.bfloat16), 1e-5) is None
    assert add_rms_norm_fp8(x, x[:2], weight, 1e-5) is None
    assert silu_and_mul_fp8(x.t().contiguous().t()) is None  # strided rows
    assert silu_and_mul_fp8(x.view(3, 8, 8)) is None
    assert silu_and_mul_fp8(torch.zeros(1, 2 * MAX_FP8_D + 2, device=DEVICE)) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_with_fp8_weights_gives_the_same_logits_fused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """A tiny Llama with fp8 weights: the norms and SwiGLU writing their rows quantized
    (our kernels; on CPU under the interpreter, handed to the model's kernel choices)
    against the same model quantizing them in each product. The same e4m3 values up to
    one step where a row rounds differently, so logits within 1e-3 relative, where fp8
    weights alone move them by ~13% (tests/unit/shard/test_fp8_weights.py)."""
    from shard.config import ShardConfig
    from shard.inputs import SeqChunk
    from shard.kernels import rms_norm, silu_mul
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import PROMPTS, make_hf_model

    make_hf_model("llama", tmp_path)
    runner = ModelRunner(
        ShardConfig(
            model_path=str(tmp_path),
            device=DEVICE,
            dtype=dtype,
            block_size=4,
            kv_cache_bytes=1 << 20,
            quantization="fp8",
            cuda_graphs="0",
        )
    )
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    launches: list[str] = []

    def counted(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            launches.append(name)
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(
        runner.kernels, "add_rms_norm_fp8", counted("norm", rms_norm.add_rms_norm_fp8)
    )
    monkeypatch.setattr(
        runner.kernels, "silu_and_mul_fp8", counted("silu", silu_mul.silu_and_mul_fp8)
    )
    prompt = PROMPTS[3]
    chunk = SeqChunk(prompt, 0, list(range(-(-len(prompt) // 4))))
    with torch.inference_mode():
        _, hidden = runner.run_chunks([chunk], is_prefill=True)
        fused_logits = runner.model.compute_logits(hidden)
        layers = runner.model.config.num_hidden_layers  # type: ignore[attr-defined]
        assert sorted(launches) == ["norm"] * 2 * layers + ["silu"] * layers
        with runner.kernels.disabled("add_rms_norm_fp8", "silu_and_mul_fp8"):
            _, hidden = runner.run_chunks([chunk], is_prefill=True)
            want = runner.model.compute_logits(hidden)
        assert len(launches) == 3 * layers  # none without the kernels
    err = float((fused_logits - want).norm() / want.norm())
    assert err < 1e-3, err
