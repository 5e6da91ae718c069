"""Logic of gpu_serving.py's ``--fp8`` table that needs no GPU
(benchmarks/serving/fp8_compare.py): the fp8 weight bytes of a checkpoint, the table's
cells and ratios, and the flag."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.serving.completions_load import LoadRun
from benchmarks.serving.fp8_compare import FP8_FLAGS, fp8_weight_bytes, render
from benchmarks.serving.gpu_report import Report, Row
from benchmarks.serving.gpu_serving import parse_args
from benchmarks.serving.workloads import build_workload


def test_fp8_weight_bytes_count_projections_at_a_byte_plus_row_scales(tmp_path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 6, dtype=torch.bfloat16),
               "model.layers.0.input_layernorm.weight": torch.zeros(4, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    # LM head 80, projection 24 + 4 rows x 4, norm 8; the embedding is not read
    assert fp8_weight_bytes(tmp_path) == 80 + 24 + 16 + 8


def _report(tpot: float, decode: float, prefill: float, blocks: int) -> Report:
    rows = {
        "batch1": Row(build_workload("batch1", 49152), latency=LoadRun(1, 256, 2.6, tpot=[tpot]),
                      nano={"ms_per_output_token_per_request": 5.0}),
        "decode_heavy": Row(build_workload("decode_heavy", 49152),
                            ours=LoadRun(256, 131072, 131072 / decode),
                            nano={"output_tok_per_s": 9000.0}),
        "prefill_heavy": Row(build_workload("prefill_heavy", 49152),
                             ours=LoadRun(512, 65536, 65536 / prefill)),
    }
    return Report(rows=rows, copy_bw=4e12, server_info={
        "kv_blocks_total": blocks, "block_size": 16, "model_dtype": "bfloat16",
        "quantization_details": "fp8 weights: ..."})


def test_fp8_table_shows_both_servers_their_ratios_and_the_floor() -> None:
    bf16, fp8 = _report(0.0060, 10000, 20000, 1000), _report(0.0033, 15000, 31000, 1940)
    text = render(bf16, fp8, fp8_bytes=8_000_000_000)
    assert "| ours, bfloat16 | 6.00 | 10,000 | 20,000 | 16,000 |" in text
    assert "| ours, fp8 weights + fp8 KV | 3.30 | 15,000 | 31,000 | 31,040 |" in text
    assert ("| fp8 / bfloat16 | 0.55× (target ≤ 0.60×) | 1.50× (target ≥ 1.4×) "
            "| 1.55× (target ≥ 1.5×) | 1.94× (~2×) |") in text
    assert "| nano-vllm, bfloat16 | 5.00 | 9,000 | - | - |" in text
    assert "8.00 GB / 4.000 TB/s = 2.000 ms; fp8 batch1 TPOT p50 = 1.65× the floor" in text


def test_fp8_flag_runs_the_second_pass() -> None:
    assert parse_args(["--fp8"]).fp8 and not parse_args([]).fp8
    assert FP8_FLAGS == ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
