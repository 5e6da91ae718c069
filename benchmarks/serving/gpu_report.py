"""The table of benchmarks/serving/gpu_serving.py: what was measured, gathered as the stages run,
and its markdown rendering (missing measurements shown as ``-``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_power import PowerLog, PowerStats
from benchmarks.harness import (
    cpu_model,
    decode_step_means,
    percentile,
    prefix_hits,
    today,
    versions,
)
from benchmarks.serving.completions_load import LoadRun
from benchmarks.serving.gpu_peers import HFRun
from benchmarks.serving.random_checkpoint import ARCHITECTURES
from benchmarks.serving.request_timeline import Timeline
from benchmarks.serving.workloads import Workload

MS = 1e3


@dataclass
class Row:
    """One workload: as sent to our server, and each engine's result (None = not run)."""

    workload: Workload
    ours: LoadRun | None = None  # non-streaming pass: throughput, decode-step metrics
    latency: LoadRun | None = None  # streaming pass: TTFT, TPOT
    nano: dict[str, Any] | None = None  # the nano-vllm runner's JSON line
    hf: HFRun | None = None
    timeline: Timeline | None = None  # the non-streaming pass, from the server's log


@dataclass
class Report:
    """Everything the table shows. ``write`` renders it (and saves it to a file)."""

    rows: dict[str, Row]
    device: str = "-"
    versions: str = "-"
    model: str = "-"
    load: str = "-"
    weight_bytes: int | None = None
    copy_bw: float | None = None  # bytes/s, read + written
    server_flags: str = ""
    server_info: dict[str, Any] = field(default_factory=dict)
    server_startup_s: float | None = None
    hf_setup: str = ""
    notes: list[str] = field(default_factory=list)
    power: PowerLog | None = None  # the GPU's power over the whole run
    date: str = field(default_factory=today)

    def write(self, out: Path | None) -> str:
        """The markdown text; also written to ``out`` when given."""
        text = render(self)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        return text


def new_report(args: argparse.Namespace, workloads: dict[str, Workload]) -> Report:
    """An empty report with the header facts of this run (device, versions, model, load)."""
    import torch

    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(args.device)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"{cpu_model()} (CPU)"
    arch = ARCHITECTURES[args.arch]
    inflight = "all requests at once" if args.concurrency <= 0 else f"{args.concurrency}"
    return Report(
        rows={n: Row(w.head(args.limit_requests)) for n, w in workloads.items()},
        device=device,
        versions=versions("torch", "triton", "transformers"),
        model=(f"{arch}: hidden {args.hidden}, {args.layers} layers, {args.heads}/"
               f"{args.kv_heads} heads, head dim {args.head_dim}, intermediate "
               f"{args.intermediate}, vocabulary {args.vocab}; random {args.dtype} weights "
               f"(seed {args.seed}), safetensors"),
        load=(f"`POST /v1/completions`, token-id prompts, `ignore_eos`, greedy; in flight: "
              f"{inflight}, over keep-alive connections opened before the clock starts; "
              f"non-streaming pass for tok/s, then a streaming pass "
              f"({'all' if args.latency_requests <= 0 else args.latency_requests} requests, "
              f"first id of each prompt moved by one so the prefix cache cannot serve it) "
              f"for TTFT/TPOT" + (f"; only the first {args.limit_requests} requests of each "
                                  f"workload" if args.limit_requests > 0 else "")),
        hf_setup=(f"static batches of ≤ {args.hf_max_batch}, first "
                  f"{args.hf_max_requests or 'all'} requests, {args.dtype}, sdpa, greedy, "
                  f"min_new_tokens = max_new_tokens" if args.hf_workloads else "not run"),
    )


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def _pair(values: list[float] | None, fmt: str) -> str:
    if not values:
        return "-"
    return f"{_f(percentile(values, 50) * MS, fmt)} / {_f(percentile(values, 99) * MS, fmt)}"


def _ratio(ours: float | None, peer: float | None) -> str:
    return "-" if not ours or not peer else f"{ours / peer:.2f}×"


def _row(name: str, row: Row, notes: list[str]) -> str:
    ours = row.ours.tok_s if row.ours else None
    step = "-"
    if row.ours:
        wall, fwd = decode_step_means(row.ours.metrics)
        step = f"{_f(wall * MS, '.1f')} / {_f(fwd * MS, '.1f')}"
        hits = prefix_hits(row.ours.metrics) + (prefix_hits(row.latency.metrics)
                                                 if row.latency else 0)
        if hits:
            notes.append(f"{name}: {hits:.0f} prompt tokens came from the prefix cache")
        prefills = row.ours.metrics.get("prefill_step_duration_seconds_count", 0.0)
        if prefills:
            forward = row.ours.metrics.get("prefill_step_duration_seconds_sum", 0.0)
            notes.append(f"{name}: {prefills:.0f} prefill steps took {forward:.2f} s of shard "
                         f"forward in the non-streaming pass")
    if row.timeline:
        notes.append(f"{name}, non-streaming pass (server log): {row.timeline.describe()}")
    nano = float(row.nano["output_tok_per_s"]) if row.nano else None
    nano_cell = _f(nano, ",.0f")
    if row.nano and (row.nano["requests"], row.nano["output_tokens"]) != (
            len(row.workload.prompts), row.workload.output_tokens):
        nano_cell += " ≠"
        notes.append(f"{name}: nano-vllm ran {row.nano['requests']} requests / "
                     f"{row.nano['output_tokens']} output tokens, ours "
                     f"{len(row.workload.prompts)} / {row.workload.output_tokens}")
    hf = row.hf.tok_s if row.hf else None
    hf_cell = _f(hf, ",.0f") + (f" (batch {row.hf.batch_size})" if row.hf else "")
    return (f"| {name} ({row.workload.describe()}) | {_f(ours, ',.0f')} "
            f"| {_pair(row.latency.ttft if row.latency else None, '.0f')} "
            f"| {_pair(row.latency.tpot if row.latency else None, '.1f')} | {step} "
            f"| {nano_cell} | {_ratio(ours, nano)} | {hf_cell} | {_ratio(ours, hf)} |")


def floor_line(report: Report) -> str:
    """The batch-1 weight-read floor and batch1's TPOT p50 as a multiple of it."""
    if not report.weight_bytes or not report.copy_bw:
        return "weight-read floor: not measured"
    floor = report.weight_bytes / report.copy_bw
    line = (f"weight-read floor of a batch-1 decode step: {report.weight_bytes / 1e9:.2f} GB "
            f"of weights / {report.copy_bw / 1e12:.3f} TB/s copy bandwidth (read + written, "
            f"measured in this run) = {floor * MS:.3f} ms")
    batch1 = report.rows.get("batch1")
    if batch1 and batch1.latency and batch1.latency.tpot:
        tpot = percentile(batch1.latency.tpot, 50)
        line += f"; batch1 TPOT p50 {tpot * MS:.2f} ms = {tpot / floor:.1f}× the floor"
    return line


def _power_cell(stats: PowerStats | None, tokens: int) -> tuple[str, float | None]:
    if stats is None:
        return "- | -", None
    per_token = stats.energy_j / tokens
    return (f"{stats.mean_w:.0f} W, SM {stats.sm_mhz_p50:.0f} MHz, {stats.capped:.0%} "
            f"| {per_token:.3f}"), per_token


def power_table(report: Report) -> list[str]:
    """Markdown: the GPU's power during each engine's throughput pass of each workload
    (mean power, SM clock p50, share of samples at the power cap) and the energy per
    output token; nothing when no power was sampled."""
    log = report.power
    if log is None or not log.samples:
        return []
    lines = ["", "GPU power during the throughput passes (`nvidia-smi` every "
             f"{log.interval_ms} ms; \"at cap\": share of samples whose clocks the "
             "software power cap held back):", "",
             "| workload | ours: mean power, SM clock p50, at cap | ours J per output token "
             "| nano-vllm: mean power, SM clock p50, at cap | nano-vllm J per output token "
             "| ours / nano-vllm energy per token |", "|---|---|---:|---|---:|---:|"]
    for name, row in report.rows.items():
        tokens = row.workload.output_tokens
        ours = (log.window(row.ours.started_at, row.ours.ended_at)
                if row.ours and row.ours.ended_at else None)
        nano = None
        if row.nano and "ended_at" in row.nano:
            end = float(row.nano["ended_at"])
            nano = log.window(end - float(row.nano["seconds"]), end)
        ours_cells, ours_j = _power_cell(ours, tokens)
        nano_cells, nano_j = _power_cell(nano, int(row.nano["output_tokens"]) if row.nano
                                         else tokens)
        ratio = "-" if ours_j is None or nano_j is None else f"{ours_j / nano_j:.2f}×"
        lines.append(f"| {name} | {ours_cells} | {nano_cells} | {ratio} |")
    return lines


def render(report: Report) -> str:
    """The report as markdown: header bullets, the table, then notes."""
    info = report.server_info
    server = (f"backend `{info.get('attention_backend', '-')}` (from /info), block size "
              f"{info.get('block_size', '-')}, {info.get('kv_blocks_total', '-')} KV blocks, "
              f"max_total_tokens {info.get('max_total_tokens', '-')}, dtype "
              f"{info.get('model_dtype', '-')}")
    startup = _f(report.server_startup_s, ".0f")
    notes: list[str] = []
    rows = [_row(name, row, notes) for name, row in report.rows.items()]
    lines = [
        "# Serving benchmark: shardserve vs nano-vllm vs transformers, one GPU", "",
        f"- date: {report.date}; device: {report.device}",
        f"- versions: {report.versions}",
        f"- checkpoint: {report.model}",
        f"- shardserve: {server}; `launch --executor local {report.server_flags}`, "
        f"ready after {startup} s" if report.server_flags else "- shardserve: not run",
        f"- load: {report.load}",
        f"- transformers `generate`: {report.hf_setup}",
        f"- {floor_line(report)}",
        "",
        "| workload | ours output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| decode step: router / shard forward (ms) | nano-vllm tok/s | ours / nano-vllm "
        "| transformers tok/s | ours / transformers |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        *power_table(report),
    ]
    all_notes = [*report.notes, *notes]
    if all_notes:
        lines += ["", *(f"- {n}" for n in all_notes)]
    return "\n".join(lines) + "\n"
