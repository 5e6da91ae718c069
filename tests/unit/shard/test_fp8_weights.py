"""FP8 weights: e4m3 quantization by rows, the fp8 product against the torch reference,
the fp8 linear layers (quantized at load, or read from an fp8 checkpoint with per-tensor
or per-channel scales, sharded over ranks), and a tiny model loaded both ways.

Tolerances: a quantize/dequantize round trip is exact up to e4m3's rounding, half a unit
in the last place (2^-4 relative for normal values, 2^-10 x scale for subnormals); the
fp8 product equals the float32 product of the dequantized operands up to float32
summation order (1e-5 relative)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shard.config import ShardConfig
from shard.distributed import ParallelContext, parallel_context
from shard.inputs import SeqChunk
from shard.layers.fp8 import missing_scales
from shard.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shard.model_runner import ModelRunner
from shard.quantization.config import Fp8Weights, check_fp8_device, quantization_context
from shard.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_rows,
    fp8_linear,
    quantize_rows,
    quantize_rows_mse,
)
from tests.unit.shard.helpers import PROMPTS, hf_logits

torch.manual_seed(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_round_trip_is_within_half_an_e4m3_step(dtype: torch.dtype) -> None:
    x = (torch.randn(8, 256) * torch.logspace(-3, 2, 8)[:, None]).to(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (8,)
    # each row's largest magnitude lands on e4m3's largest value
    assert torch.equal(q.float().abs().amax(-1), torch.full((8,), FP8_MAX))
    back = dequantize_rows(q, scale)
    bound = torch.maximum(x.float().abs() * 2**-4, scale[:, None] * 2**-10)
    assert ((back - x.float()).abs() <= bound * (1 + 1e-6)).all()


def test_weights_take_the_scale_of_least_squared_error() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows_mse(w)
    amax_q, amax_scale = quantize_rows(w)
    err = (dequantize_rows(q, scale) - w).square().sum(-1)
    amax_err = (dequantize_rows(amax_q, amax_scale) - w).square().sum(-1)
    # never worse than amax / 448 (one of the candidates), better overall (7% here)
    assert bool((err <= amax_err * (1 + 1e-6)).all()) and err.sum() < 0.95 * amax_err.sum()
    assert bool((scale <= amax_scale * (1 + 1e-6)).all())
    assert bool((scale >= 0.5 * amax_scale * (1 - 1e-6)).all())
    zeros_q, zeros_scale = quantize_rows_mse(torch.zeros(2, 8))
    assert torch.equal(zeros_q.float(), torch.zeros(2, 8)) and bool((zeros_scale > 0).all())


def test_quantize_rows_of_zeros_gives_zeros() -> None:
    q, scale = quantize_rows(torch.zeros(2, 16))
    assert torch.equal(q.float(), torch.zeros(2, 16)) and bool((scale > 0).all())


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_equals_the_product_of_dequantized_operands(rows: int, static: bool) -> None:
    x, w, bias = torch.randn(rows, 96), torch.randn(40, 96), torch.randn(40)
    w_q, w_scale = quantize_rows(w)
    input_scale = torch.tensor(x.abs().max().item() / FP8_MAX) if static else None
    out = fp8_linear(x, w_q, w_scale, bias, input_scale)
    if static:
        assert input_scale is not None
        x_deq = (x / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * input_scale
    else:
        x_deq = dequantize_rows(*quantize_rows(x))
    ref = x_deq @ dequantize_rows(w_q, w_scale).T + bias
    assert out.shape == (rows, 40) and out.dtype == x.dtype
    assert _rel(out, ref) < 1e-5
    # and close to the unquantized product (two e4m3 roundings: a few percent)
    assert _rel(out, x @ w.T + bias) < 0.06


def test_fp8_linear_keeps_bfloat16() -> None:
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(32, 64)
    out = fp8_linear(x, *quantize_rows(w))
    assert out.dtype == torch.bfloat16 and _rel(out, x.float() @ w.T) < 0.06


def _build(cls: type, *args: object, rank: int = 0, size: int = 1,
           fp8: Fp8Weights | None = None) -> torch.nn.Module:
    with parallel_context(ParallelContext(rank, size)), \
            quantization_context(fp8 or Fp8Weights()):
        return cls(*args)  # type: ignore[no-any-return]


def test_column_layer_quantizes_each_output_row_at_load() -> None:
    w = torch.randn(48, 32)
    layer = _build(ColumnParallelLinear, 32, 48)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.weight.dtype == FP8_DTYPE and layer.input_scale is None
    q, scale = quantize_rows_mse(w)
    assert torch.equal(layer.weight.float(), q.float()) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(3, 32)
    assert _rel(layer(x), fp8_linear(x, q, scale)) == 0.0
    assert missing_scales(layer) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_and_sharded_layers_take_their_rows_and_scales(rank: int) -> None:
    """q/k/v and gate/up at TP=2: each rank quantizes the rows it holds (the same bits
    as quantizing the full tensor: the scales are per row); row-parallel scales cover
    every output row of the rank's input slice."""
    q_w, k_w, v_w = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32)
    qkv = _build(QKVParallelLinear, 32, 16, 4, 2, rank=rank, size=2)
    for shard_id, w in (("q", q_w), ("k", k_w), ("v", v_w)):
        qkv.weight.weight_loader(qkv.weight, w, shard_id)
    full = torch.cat([q_w[rank * 32:(rank + 1) * 32], k_w[rank * 16:(rank + 1) * 16],
                      v_w[rank * 16:(rank + 1) * 16]])
    q, scale = quantize_rows_mse(full)
    assert torch.equal(qkv.weight.float(), q.float()) and torch.equal(qkv.weight_scale, scale)

    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    gate_up = _build(MergedColumnParallelLinear, 32, [64, 64], rank=rank, size=2)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    rows = torch.cat([gate[rank * 32:(rank + 1) * 32], up[rank * 32:(rank + 1) * 32]])
    assert torch.equal(gate_up.weight_scale, quantize_rows_mse(rows)[1])

    down_w = torch.randn(32, 64)
    down = _build(RowParallelLinear, 64, 32, rank=rank, size=2)
    down.weight.weight_loader(down.weight, down_w)
    assert down.weight_scale.shape == (32,)
    assert torch.equal(down.weight_scale,
                       quantize_rows_mse(down_w[:, rank * 32:(rank + 1) * 32])[1])


@pytest.mark.parametrize("scale_shape", ["tensor", "channel", "channel_column"])
@pytest.mark.parametrize("rank", [0, 1])
def test_fp8_checkpoint_rows_and_scales_are_read_as_they_are(scale_shape: str,
                                                              rank: int) -> None:
    fp8 = Fp8Weights(from_checkpoint=True, static_activations=True)
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    layer = _build(MergedColumnParallelLinear, 32, [64, 64], rank=rank, size=2, fp8=fp8)
    down = _build(RowParallelLinear, 64, 32, rank=rank, size=2, fp8=fp8)
    down_w = torch.randn(32, 64)
    expected_rows, expected_scales = [], []
    for shard_id, w in ((0, gate), (1, up)):
        if scale_shape == "tensor":
            scale = w.abs().max() / FP8_MAX
            q = (w / scale).to(FP8_DTYPE)
            rows_scale = scale.expand(32)
        else:
            q, scale = quantize_rows(w)
            rows_scale = scale[rank * 32:(rank + 1) * 32]
            scale = scale[:, None] if scale_shape == "channel_column" else scale
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(0.5 + shard_id),
                                        shard_id)
        expected_rows.append(q[rank * 32:(rank + 1) * 32])
        expected_scales.append(rows_scale)
    assert torch.equal(layer.weight.float(), torch.cat(expected_rows).float())
    assert torch.equal(layer.weight_scale, torch.cat(expected_scales))
    assert layer.input_scale.item() == 1.5  # the larger of the two tensors'
    # row-parallel: the column slice of the weight, every output row's scale
    q, scale = quantize_rows(down_w)
    down.weight.weight_loader(down.weight, q)
    down.weight_scale.weight_loader(down.weight_scale, scale)
    assert torch.equal(down.weight.float(), q[:, rank * 32:(rank + 1) * 32].float())
    assert torch.equal(down.weight_scale, scale)
    assert missing_scales(down) == ["input_scale"]  # never loaded: still NaN


def test_cpu_runs_fp8_and_old_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    check_fp8_device(torch.device("cpu"), "--quantization fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs fp8 tensor cores.*sm80"):
        check_fp8_device(torch.device("cuda", 0), "--kv-cache-dtype fp8")


def _runner(folder: Path, **kw: object) -> ModelRunner:
    config = ShardConfig(model_path=str(folder), device="cpu", dtype="float32", block_size=4,
                         kv_cache_bytes=1 << 20, **kw)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    return runner


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        _, hidden = runner.run_chunks([SeqChunk(prompt, 0, list(range(12)))], is_prefill=True)
        return runner.model.compute_logits(hidden)


def _write_fp8_checkpoint(src: Path, dest: Path, static: bool) -> None:
    """``src``'s model with every decoder linear weight in e4m3 with a per-tensor
    ``weight_scale`` (and an ``input_scale`` when ``static``), as AutoFP8 writes it."""
    from safetensors.torch import load_file

    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            scale = tensor.abs().max() / FP8_MAX
            tensors[name] = (tensor / scale).to(FP8_DTYPE)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(())
            if static:
                tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
            tensors[name.removesuffix("proj.weight") + "proj.k_scale"] = torch.tensor(1.0)
        else:
            tensors[name] = tensor
    save_file(tensors, dest / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "ignored_layers": ["lm_head"],
                                     "activation_scheme": "static" if static else "dynamic"}
    (dest / "config.json").write_text(json.dumps(config))


def test_tiny_model_with_fp8_weights_stays_close_to_transformers(llama) -> None:
    folder, hf = llama
    prompt = PROMPTS[3]
    ref = hf_logits(hf, prompt)
    exact, fp8 = _runner(folder), _runner(folder, quantization="fp8")
    assert _rel(_logits(exact, prompt), ref) < 1e-5
    err = _rel(_logits(fp8, prompt), ref)
    # quantized, and still the same model (a random model without structure: each layer's
    # two e4m3 roundings of ~4% add up to ~13% on these logits)
    assert 1e-3 < err < 0.2, err
    assert fp8.model.model.embed_tokens.weight.dtype == torch.float32
    assert fp8.model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("static", [False, True])
def test_fp8_checkpoint_loads_without_a_round_trip(llama, tmp_path: Path, static: bool) -> None:
    folder, hf = llama
    _write_fp8_checkpoint(folder, tmp_path, static)
    with pytest.raises(ValueError, match="start with --quantization fp8"):
        _runner(tmp_path)
    runner = _runner(tmp_path, quantization="fp8")
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert (layer.input_scale is not None) == static
    assert torch.unique(layer.weight_scale).numel() == 3  # q, k and v: one scale each
    assert _rel(_logits(runner, PROMPTS[3]), hf_logits(hf, PROMPTS[3])) < 0.2


def test_fp8_checkpoint_without_its_scales_is_refused(llama, tmp_path: Path) -> None:
    folder, _ = llama
    _write_fp8_checkpoint(folder, tmp_path, static=False)
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(tmp_path / "model.safetensors").items()
               if k != "model.layers.1.mlp.down_proj.weight_scale"}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.down_proj"
                                         r"\.weight_scale"):
        _runner(tmp_path, quantization="fp8")


def test_block_wise_fp8_checkpoints_are_refused(llama, tmp_path: Path) -> None:
    folder, _ = llama
    _write_fp8_checkpoint(folder, tmp_path, static=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weight_block_size"):
        _runner(tmp_path, quantization="fp8")


def test_fp8_at_two_ranks_stays_with_one(llama, tmp_path: Path) -> None:
    """TP=2 (gloo): column-parallel layers split the scales, row-parallel ones keep every
    row's, each rank's quantized from its own input slice (so not the same bits as TP=1;
    within e4m3 rounding of it), with the fp8 KV cache split by heads."""
    from tests.unit.shard.tp_harness import run_tp

    folder, _ = llama
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    runs = {}
    for name, size, overrides in (("one", 1, fp8), ("two", 2, fp8), ("exact", 1, None)):
        (tmp_path / name).mkdir()
        runs[name] = run_tp(folder, size, PROMPTS[2:], 2, tmp_path / name, overrides=overrides)
    one, two, exact = runs["one"], runs["two"], runs["exact"]
    # as close to the unquantized model as TP=1 is (a random tiny model: ~13%), which a
    # misplaced scale (a wrong row or rank) would be far from
    err_one, err_two = _rel(one["logits"], exact["logits"]), _rel(two["logits"], exact["logits"])
    assert 1e-3 < err_one < 0.2 and 1e-3 < err_two < 1.25 * err_one, (err_one, err_two)
