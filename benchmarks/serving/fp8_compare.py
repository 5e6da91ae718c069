"""The FP8 table of benchmarks/serving/gpu_serving.py (``--fp8``): our server in the
model's dtype and with fp8 weights and an fp8 KV cache, on the same checkpoint and
workloads in the same run, beside nano-vllm: batch-1 TPOT against the fp8 weight-read
floor, decode-heavy and prefill-heavy output tokens/s, and the KV cache's capacity.

The issue's targets (issue 49) are printed with the ratios: fp8 batch-1 TPOT ≤ 0.6× ours
in bf16 and ≤ 1.3× the fp8 weight-read floor; decode-heavy ≥ 1.4× and prefill-heavy
≥ 1.5× our bf16 tok/s."""

from __future__ import annotations

import math
import re
from pathlib import Path

from benchmarks.harness import percentile
from benchmarks.serving.gpu_report import Report

# What the second pass of our server adds to its flags.
FP8_FLAGS = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
MS = 1e3
# Decoder linear weights: stored as e4m3 with a float32 scale per output row under fp8.
_LINEAR = re.compile(r"model\.layers\.\d+\..*proj\.weight$")
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


def fp8_weight_bytes(folder: Path) -> int:
    """Bytes of weights one decode step reads with ``--quantization fp8``: the decoder
    layers' projections at one byte per weight plus a float32 scale per output row, the
    rest as stored (the embedding table left out when the LM head has its own weight)."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                if _LINEAR.match(key):
                    sizes[key] = math.prod(shape) + 4 * shape[0]
                else:
                    sizes[key] = math.prod(shape) * _ITEMSIZE[st.get_slice(key).get_dtype()]
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values())


def _tpot_ms(report: Report) -> float | None:
    row = report.rows.get("batch1")
    if row is None or row.latency is None or not row.latency.tpot:
        return None
    return percentile(row.latency.tpot, 50) * MS


def _tok_s(report: Report, workload: str) -> float | None:
    row = report.rows.get(workload)
    return row.ours.tok_s if row is not None and row.ours is not None else None


def _kv_tokens(report: Report) -> int | None:
    info = report.server_info
    if "kv_blocks_total" not in info:
        return None
    return int(info["kv_blocks_total"]) * int(info["block_size"])


def _nano(report: Report, workload: str, key: str) -> float | None:
    row = report.rows.get(workload)
    if row is None or row.nano is None or row.nano.get(key) is None:
        return None
    return float(row.nano[key])


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(new: float | None, old: float | None, target: str) -> str:
    return "-" if not new or not old else f"{new / old:.2f}× ({target})"


def render(bf16: Report, fp8: Report, fp8_bytes: int | None) -> str:
    """The FP8 section: a markdown table of ours in the model's dtype, ours with fp8
    weights and KV cache, their ratios against the targets, and nano-vllm."""
    tpot, tpot8 = _tpot_ms(bf16), _tpot_ms(fp8)
    decode, decode8 = _tok_s(bf16, "decode_heavy"), _tok_s(fp8, "decode_heavy")
    prefill, prefill8 = _tok_s(bf16, "prefill_heavy"), _tok_s(fp8, "prefill_heavy")
    kv, kv8 = _kv_tokens(bf16), _kv_tokens(fp8)
    dtype = bf16.server_info.get("model_dtype", "bf16")
    lines = [
        "", "## FP8: fp8 weights + fp8 KV cache against our own " + str(dtype), "",
        f"- fp8 server: `{' '.join(FP8_FLAGS)}` added to the flags above; /info: "
        f"{fp8.server_info.get('quantization_details', '-')}",
        "",
        "| engine | batch1 TPOT p50 (ms) | decode_heavy tok/s | prefill_heavy tok/s "
        "| KV capacity (tokens) |",
        "|---|---|---|---|---|",
        f"| ours, {dtype} | {_cell(tpot, '.2f')} | {_cell(decode, ',.0f')} "
        f"| {_cell(prefill, ',.0f')} | {_cell(kv, ',')} |",
        f"| ours, fp8 weights + fp8 KV | {_cell(tpot8, '.2f')} | {_cell(decode8, ',.0f')} "
        f"| {_cell(prefill8, ',.0f')} | {_cell(kv8, ',')} |",
        f"| fp8 / {dtype} | {_ratio(tpot8, tpot, 'target ≤ 0.60×')} "
        f"| {_ratio(decode8, decode, 'target ≥ 1.4×')} "
        f"| {_ratio(prefill8, prefill, 'target ≥ 1.5×')} | {_ratio(kv8, kv, '~2×')} |",
        f"| nano-vllm, {dtype} | {_cell(_nano(bf16, 'batch1', 'ms_per_output_token_per_request'), '.2f')} "  # noqa: E501
        f"| {_cell(_nano(bf16, 'decode_heavy', 'output_tok_per_s'), ',.0f')} "
        f"| {_cell(_nano(bf16, 'prefill_heavy', 'output_tok_per_s'), ',.0f')} | - |",
    ]
    if fp8_bytes and bf16.copy_bw:
        floor = fp8_bytes / bf16.copy_bw * MS
        line = (f"- fp8 weight-read floor of a batch-1 decode step: {fp8_bytes / 1e9:.2f} GB / "
                f"{bf16.copy_bw / 1e12:.3f} TB/s = {floor:.3f} ms")
        if tpot8:
            line += f"; fp8 batch1 TPOT p50 = {tpot8 / floor:.2f}× the floor (target ≤ 1.3×)"
        lines += ["", line]
    lines += ["", "- nano-vllm's batch1 column: its wall time / output tokens (it streams "
              "nothing); its KV capacity is not reported by its runner"]
    return "\n".join(lines) + "\n"
