"""Which kernel runs an fp8 product of a few rows (:mod:`shard.kernels.fp8_tuning`): the
table warm-up fills, the routing through the model's kernel choices, a tiny model's
logits through the skinny fp8 kernel against ``torch._scaled_mm``, and (GPU) the
warm-up's timing of the two.

CPU: Triton's interpreter; GPU: compiled. Tolerance of the logits: on the CPU the two
products sum the same exact e4m3 products in float32 in another order, so logits within
1e-5 relative (float32 model); on CUDA both write bfloat16 and Hopper's fp8 tensor cores
keep fewer bits of the sum, so within 1e-2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from shard.kernels.choices import KernelChoices
from shard.kernels.fp8_tuning import Fp8Table, tune
from shard.kernels.skinny_gemm import MAX_ROWS, skinny_fp8_linear
from shard.quantization.fp8 import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_table_keeps_the_skinny_kernel_unless_measured_slower() -> None:
    table = Fp8Table()
    assert table.skinny(1, 4096, 4096)  # nothing measured: the skinny kernel
    table.record(1, 4096, 4096, skinny=False)
    assert not table.skinny(1, 4096, 4096)
    assert table.skinny(2, 4096, 4096) and table.skinny(1, 6144, 4096)  # other products
    table.record(1, 4096, 4096, skinny=True)
    assert table.skinny(1, 4096, 4096)
    table.record(3, 64, 32, skinny=False)
    table.clear()
    assert table.skinny(3, 64, 32)


def test_kernel_choices_route_fp8_products_by_the_table() -> None:
    x_q, x_scale = quantize_rows(torch.randn(2, 64, device=DEVICE))
    w_q, w_scale = quantize_rows(torch.randn(32, 64, device=DEVICE))
    assert KernelChoices().fp8_product(x_q, x_scale, w_q, w_scale, torch.float32) is None
    choices = KernelChoices(skinny_fp8_linear=skinny_fp8_linear)
    out = choices.fp8_product(x_q, x_scale, w_q, w_scale, torch.float32)
    assert out is not None and out.shape == (2, 32)
    choices.fp8_gemms.record(2, 32, 64, skinny=False)  # measured slower at 2 rows
    assert choices.fp8_product(x_q, x_scale, w_q, w_scale, torch.float32) is None
    assert choices.fp8_product(x_q[:1], x_scale[:1], w_q, w_scale, torch.float32) is not None
    with choices.disabled("skinny_fp8_linear"):
        assert choices.fp8_product(x_q[:1], x_scale[:1], w_q, w_scale, torch.float32) is None


def test_tiny_fp8_model_gives_the_same_logits_through_the_skinny_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shard.config import ShardConfig
    from shard.inputs import SeqChunk
    from shard.model_runner import ModelRunner
    from tests.unit.shard.helpers import PROMPTS, make_hf_model

    make_hf_model("llama", tmp_path)
    runner = ModelRunner(ShardConfig(model_path=str(tmp_path), device=DEVICE, dtype="float32",
                                     block_size=4, kv_cache_bytes=1 << 20, quantization="fp8",
                                     cuda_graphs="0"))
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    launches: list[tuple[int, ...]] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append(tuple(args[2].shape))
        return skinny_fp8_linear(*args, **kwargs)

    monkeypatch.setattr(runner.kernels, "skinny_fp8_linear", counted)
    prompt = PROMPTS[1]  # 5 tokens: a product of a few rows
    assert len(prompt) <= MAX_ROWS
    chunk = SeqChunk(prompt, 0, list(range(-(-len(prompt) // 4))))

    def logits() -> torch.Tensor:
        _, hidden = runner.run_chunks([chunk], is_prefill=True)
        return runner.model.compute_logits(hidden)

    with torch.inference_mode():
        skinny = logits()
        layers = runner.model.config.num_hidden_layers  # type: ignore[attr-defined]
        assert len(launches) == 4 * layers  # qkv, o, gate_up, down of every layer
        with runner.kernels.disabled("skinny_fp8_linear"):
            want = logits()
        assert len(launches) == 4 * layers
        # the table sends the o_proj shape back to torch._scaled_mm
        n, k = runner.model.model.layers[0].self_attn.o_proj.weight.shape  # type: ignore[attr-defined]
        o_shape = (n, k)
        runner.kernels.fp8_gemms.record(len(prompt), n, k, skinny=False)
        mixed = logits()
    assert len(launches) == 7 * layers and o_shape not in launches[4 * layers:]
    for got in (skinny, mixed):
        err = float((got - want).norm() / want.norm())
        assert err < (1e-5 if DEVICE == "cpu" else 1e-2), err


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA kernels")
def test_tune_times_both_products_at_every_row_count() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [quantize_rows(torch.randn(n, 512, generator=gen).to(DEVICE))
              for n in (256, 256, 1024)]
    table = Fp8Table()
    timings = tune(table, layers, skinny_fp8_linear, MAX_ROWS)
    assert {(t.n, t.k) for t in timings} == {(256, 512), (1024, 512)}
    assert sorted(t.rows for t in timings if t.n == 256) == list(range(1, MAX_ROWS + 1))
    for t in timings:
        assert 0 < t.skinny_us < 1e4 and 0 < t.library_us < 1e4
        assert table.skinny(t.rows, t.n, t.k) == t.skinny
