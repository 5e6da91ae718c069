"""The decoder layer's small ops compiled on CUDA (skipped elsewhere) against their eager
versions, which are the reference: close in bfloat16, and in float32."""

from __future__ import annotations

import pytest
import torch

from shard.layers import fused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert a.dtype == b.dtype and a.shape == b.shape and err < tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 256])
def test_compiled_ops_match_eager(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    dev = "cuda"
    x = torch.randn(num_tokens, 512, device=dev, dtype=dtype)
    res = torch.randn(num_tokens, 512, device=dev, dtype=dtype)
    w = torch.rand(512, device=dev, dtype=dtype) + 0.5
    _close(fused.rms_norm(x, w, 1e-5), fused.rms_norm.eager(x, w, 1e-5), dtype)  # type: ignore[attr-defined]
    got, total = fused.add_rms_norm(x, res, w, 1e-5)
    want, want_total = fused.add_rms_norm.eager(x, res, w, 1e-5)  # type: ignore[attr-defined]
    _close(got, want, dtype)
    _close(total, want_total, dtype)
    gate_up = torch.randn(num_tokens, 2 * 512, device=dev, dtype=dtype)
    _close(fused.silu_and_mul(gate_up), fused.silu_and_mul.eager(gate_up), dtype)  # type: ignore[attr-defined]
    q = torch.randn(num_tokens, 8, 128, device=dev, dtype=dtype)
    k = torch.randn(num_tokens, 2, 128, device=dev, dtype=dtype)
    angles = torch.rand(num_tokens, 1, 128, device=dev) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for a, b in zip(fused.apply_rotary(q, k, cos, sin),
                    fused.apply_rotary.eager(q, k, cos, sin), strict=True):  # type: ignore[attr-defined]
        _close(a, b, dtype)
