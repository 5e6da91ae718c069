"""Per-token fp8 quantization as the last step of our elementwise kernels (RMSNorm,
SwiGLU's ``silu(gate) * up``): the row a program holds is written as float8 e4m3 with
its scale, ready for the fp8 product that follows (:func:`shard.quantization.fp8.fp8_linear`
with :class:`~shard.quantization.fp8.Fp8Activations`), instead of being written in the
model's dtype and read back by :func:`shard.quantization.fp8.quantize_rows`.

The numerics are those of the unfused ops, bit for bit where the float32 inputs agree:
the row is rounded to the model's dtype as the eager op rounds it, then quantized as
:func:`~shard.quantization.fp8.quantize_rows` does (``scale = max(amax / 448, 1e-12)``,
``q = clamp(y / scale, ±448)`` rounded to the nearest e4m3 value, ties to even), with
IEEE divisions (``div_rn``) where torch divides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shard.kernels.attention.cache_write import FP8_MAX, MIN_SCALE, round_to_e4m3


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` (round to nearest even), as float32.

    NOTE: bfloat16 by its bits (add half an ulp, plus one where the kept bit is odd, and
    drop the low 16): a GPU's conversion rounds the same way, but Triton's CPU
    interpreter truncates, and the rounded value decides the row's amax, so its scale.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        rounded = bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        rounded = x
    else:
        rounded = x.to(dtype).to(tl.float32)
    return rounded


@triton.jit
def quantize_row(y):
    """``y`` [BLOCK] float32 (elements outside the row 0) → (e4m3 values as float32,
    exact in e4m3, [BLOCK]; the row's scale, float32 scalar): ``y ≈ q * scale``."""
    amax = tl.max(tl.abs(y), 0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    q = round_to_e4m3(tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX))
    return q, scale
