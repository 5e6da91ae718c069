"""End-to-end serving benchmark on one GPU: our server over HTTP, side by side with
nano-vllm and transformers ``generate`` on the same checkpoint and the same requests,
in one run that prints one markdown table.

1. Checkpoint: a ``Qwen3ForCausalLM`` (``--arch llama``: ``LlamaForCausalLM``) with
   Llama-3-8B dimensions (hidden 4096, 32 layers, 32/8 heads, head dim 128, intermediate
   14336) and vocabulary 49152, random weights (seeded) built on the device and saved as
   safetensors, plus the tokenizer files of ``--tokenizer`` (default: the default model's,
   whose vocabulary is 49152). ``--tiny`` or ``--hidden``/``--layers``/... shrink it.
2. Our server: ``python -m router.cli launch --executor local`` on that folder, warm-up
   requests, then per workload (benchmarks/serving/workloads.py: bench, batch1, prefill_heavy,
   decode_heavy, the nano-vllm runner's prompts) two passes over ``POST /v1/completions``
   with token-id prompts, ``ignore_eos``, greedy, at most ``--concurrency`` requests in
   flight (0 = all at once): non-streaming for output tokens/s; streaming (each prompt's
   first id moved by one, so that no block of the first pass is reused from the prefix
   cache) for TTFT and TPOT per request. Every answer's token counts are checked. The
   server's ``/metrics`` before and after the first pass give the mean decode step as the
   router sees it (around the gRPC call) and the shard's forward.
3. nano-vllm (``--nano-vllm`` and ``--nano-vllm-runner``; skipped when not given) in a
   subprocess on the same folder and workloads; its token counts are checked against ours.
4. transformers ``generate`` (static batches of at most ``--hf-max-batch``, greedy, sdpa).
5. The GPU's power over the run (``nvidia-smi`` in the background,
   benchmarks/gpu_power.py): per throughput pass of ours and nano-vllm, mean power, SM
   clock, the share of time at the power cap, and joules per output token.
6. The table, and the weight-read floor of a batch-1 decode step: weight bytes read per
   step (embedding table left out unless tied) / device copy bandwidth measured in this
   run (bytes read + written by a large ``Tensor.copy_``), with batch1's TPOT p50 as a
   multiple of it.
7. With ``--fp8``: our server a second time with fp8 weights and an fp8 KV cache
   (``--quantization fp8 --kv-cache-dtype fp8``) over the same workloads, and a table of
   both beside nano-vllm (benchmarks/serving/fp8_compare.py): batch1 TPOT and the fp8
   weight-read floor, decode_heavy and prefill_heavy tok/s, KV capacity in tokens.

Stages run one after another (each engine gets the whole GPU); after each the table so
far is written to ``--out``. A stage that fails is noted under the table (traceback and
log tail on stderr) and the next one still runs. Logs of every subprocess go to
``--log-dir``. ``--checkpoint-dir`` keeps the checkpoint, so that a second run can reuse
it (e.g. ``--skip-ours`` for the peers alone). ``benchmarks/serving/gpu_prepare.sh`` packs what a
machine without network needs and prints the command for it.

    python -m benchmarks.serving.gpu_serving --nano-vllm .device/peers/nano-vllm \\
        --nano-vllm-runner .device/peers/nano_vllm_bench.py --extra-site /tmp/fa --out t.md
    python -m benchmarks.serving.gpu_serving --device cpu --tiny --arch llama --limit-requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gpu_power import PowerLog
from benchmarks.harness import (
    REPO_ROOT,
    copy_bandwidth,
    free_port,
    start_server,
    stop_server,
    tail,
    wait_healthy,
)
from benchmarks.serving import fp8_compare, gpu_report
from benchmarks.serving.completions_load import run_load
from benchmarks.serving.gpu_peers import run_nano_vllm, run_transformers
from benchmarks.serving.gpu_report import Report, Row
from benchmarks.serving.random_checkpoint import (
    ARCHITECTURES,
    LLAMA3_8B_DIMS,
    TINY_DIMS,
    check_checkpoint,
    weight_bytes,
    write_checkpoint,
)
from benchmarks.serving.request_timeline import between, late_compiles, read_finished, timeline
from benchmarks.serving.workloads import WORKLOAD_NAMES, Workload, build_workload, distinct_prefix
from router.model_files import default_model_dir


def prepare_checkpoint(args: argparse.Namespace, folder: Path) -> int:
    """Write the checkpoint into ``folder``, or reuse the one there (``--checkpoint-dir``
    of an earlier run) after checking its dimensions; returns :func:`weight_bytes`."""
    if (folder / "config.json").exists():
        check_checkpoint(args, folder)
        _log(f"reusing the checkpoint in {folder}")
    else:
        write_checkpoint(args, folder)
    return weight_bytes(folder)


# ---- our server ---------------------------------------------------------------------------

def warmup_workload(vocab: int, n: int, seed: int) -> Workload:
    """``n`` requests of 16–1024 prompt ids and 4–48 output tokens (own seeds, so no
    prefix is shared with a measured workload): kernels compiled, allocator warm."""
    rng = random.Random(1000 + seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 1024))]
               for _ in range(n)]
    return Workload("warmup", prompts, [rng.randint(4, 48) for _ in range(n)])


def server_flags(args: argparse.Namespace, most_requests: int) -> list[str]:
    if args.our_defaults:  # every budget as the server derives it
        return ["--device", args.device, *shlex.split(args.server_args)]
    return ["--device", args.device, "--dtype", args.dtype,
            "--attention-backend", args.attention_backend, "--block-size", str(args.block_size),
            "--max-batch-size", str(args.max_batch_size),
            "--max-concurrent-requests", str(max(4096, 2 * most_requests)),
            "--gpu-memory-fraction", str(args.gpu_memory_fraction),
            *shlex.split(args.server_args)]


def bench_ours(args: argparse.Namespace, ckpt: Path, workloads: list[Workload],
               report: Report, extra_flags: tuple[str, ...] = (),
               log_name: str = "server.log") -> None:
    """Serve ``ckpt`` (with ``extra_flags`` after the others) and run every workload
    (throughput, then latency pass) into ``report``'s rows; server info and start-up time
    into the report."""
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = args.log_dir / log_name
    flags = [*server_flags(args, max(len(w.prompts) for w in workloads)), *extra_flags]
    report.server_flags = " ".join(flags)
    path = [*([args.extra_site] if args.extra_site else []), *_pythonpath(), str(REPO_ROOT)]
    env = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(path)}
    started = time.perf_counter()
    proc = start_server(port, str(ckpt), flags, log_path, env=env)
    try:
        wait_healthy(proc, base, log_path, args.startup_timeout)
        report.server_startup_s = time.perf_counter() - started
        report.server_info = httpx.get(f"{base}/info", timeout=10).json()
        _log(f"server up after {report.server_startup_s:.0f}s: {report.server_info}")
        if args.warmup_requests:
            asyncio.run(run_load(base, warmup_workload(args.vocab, 1, 0), 1, True))
            asyncio.run(run_load(base, warmup_workload(args.vocab, args.warmup_requests, 1),
                                 0, False))
        for w in workloads:
            row = report.rows[w.name]
            row.ours = asyncio.run(run_load(base, w, args.concurrency, False))
            _log(f"ours {w.name}: {row.ours.tok_s:.1f} tok/s in {row.ours.wall:.1f}s")
            row.timeline = timeline(between(read_finished(log_path), row.ours.started_at,
                                            row.ours.ended_at))
            latency = distinct_prefix(w, args.vocab).head(args.latency_requests)
            row.latency = asyncio.run(run_load(base, latency, args.concurrency, True))
            _log(f"ours {w.name} streaming: {row.latency.tok_s:.1f} tok/s")
            report.write(args.out)
        compiled = late_compiles(log_path)
        report.notes.append(f"{log_name}: {len(compiled)} Triton kernel variants compiled "
                            "while serving" + (f" ({', '.join(compiled)})" if compiled else ""))
        report.write(args.out)
    except Exception:
        _log(f"server log tail ({log_path}):\n{tail(log_path)}")
        raise
    finally:
        stop_server(proc)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- main -------------------------------------------------------------------------------

@dataclass
class Stage:
    """Runs one stage, turning its failure into a note of the report (so that the other
    stages still run: device time is scarce)."""

    report: Report
    out: Path | None

    def run(self, name: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        _log(f"{name}: start")
        try:
            result = fn(*args)
        except Exception as error:  # reported; the next stages still run
            _log(f"{name} FAILED:\n{traceback.format_exc()}")
            lines = [line for line in str(error).splitlines() if line.strip()] or [""]
            said = lines[0][:200] + (f" … {lines[-1][:200]}" if len(lines) > 1 else "")
            self.report.notes.append(f"{name} failed: {type(error).__name__}: {said} "
                                     "(details on stderr and in the log dir)")
            return None
        finally:
            self.report.write(self.out)
        _log(f"{name}: done in {time.perf_counter() - t0:.0f}s")
        return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("checkpoint")
    m.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3",
                   help="qwen3: Qwen3ForCausalLM (what nano-vllm serves); llama: LlamaForCausalLM")
    m.add_argument("--tiny", action="store_true",
                   help=f"small dimensions for CPU checks: {TINY_DIMS}")
    for name, value in LLAMA3_8B_DIMS.items():
        m.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {value} ({TINY_DIMS[name]} with --tiny)")
    m.add_argument("--device", default="cuda", help="cuda | cpu")
    m.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument("--tokenizer", type=Path, default=default_model_dir(),
                   help="folder with tokenizer.json etc. (default: the default model)")
    m.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where to write the checkpoint, kept; one already there (same "
                        "dimensions) is reused (default: a temporary folder, removed)")
    s = p.add_argument_group("our server")
    s.add_argument("--skip-ours", action="store_true",
                   help="peers only (e.g. a second run on a reused --checkpoint-dir)")
    s.add_argument("--our-defaults", action="store_true",
                   help="launch our server with its default flags (only --device and "
                        "--server-args): the options below are not passed")
    s.add_argument("--attention-backend", default="auto")
    s.add_argument("--block-size", type=int, default=256,
                   help="tokens per KV block (256: flash-attn's paged block, nano-vllm's)")
    s.add_argument("--max-batch-size", type=int, default=256)
    s.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    s.add_argument("--server-args", default="", help="more launch flags, one string")
    s.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    s.add_argument("--startup-timeout", type=float, default=600)
    s.add_argument("--fp8", action="store_true",
                   help="then our server again with " + " ".join(fp8_compare.FP8_FLAGS)
                        + ", and the FP8 table (both, and nano-vllm)")
    w = p.add_argument_group("workloads")
    w.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    w.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight (0: all at once)")
    w.add_argument("--latency-requests", type=int, default=0,
                   help="requests of each streaming pass (first N; 0: all)")
    w.add_argument("--limit-requests", type=int, default=0,
                   help="first N requests of each workload for ours and transformers "
                        "(smoke tests; 0: all). nano-vllm always runs whole workloads")
    w.add_argument("--warmup-requests", type=int, default=48)
    q = p.add_argument_group("peers")
    q.add_argument("--nano-vllm", type=Path, help="nano-vllm folder (holds nanovllm/)")
    q.add_argument("--nano-vllm-runner", type=Path, help="path of nano_vllm_bench.py")
    q.add_argument("--extra-site", default=None,
                   help="site folder with flash-attn, put first on PYTHONPATH of nano-vllm "
                        "and of our server")
    q.add_argument("--peer-timeout", type=float, default=480)
    q.add_argument("--skip-hf", action="store_true", help="no transformers peer")
    q.add_argument("--hf-workloads", default="batch1,decode_heavy",
                   help="uniform-length workloads for transformers")
    q.add_argument("--hf-max-batch", type=int, default=64)
    q.add_argument("--hf-max-requests", type=int, default=64,
                   help="first N requests of each transformers workload (0: all)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="also write the table (markdown) here")
    o.add_argument("--log-dir", type=Path, default=None,
                   help="subprocess logs (default: a temporary folder, kept)")
    args = p.parse_args(argv)
    dims = TINY_DIMS if args.tiny else LLAMA3_8B_DIMS
    for name, value in dims.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="gpu-serving-logs-"))
    args.workloads = [n for n in args.workloads.split(",") if n]
    args.hf_workloads = [] if args.skip_hf else [n for n in args.hf_workloads.split(",") if n]
    for name in (*args.workloads, *args.hf_workloads):
        if name not in WORKLOAD_NAMES:
            p.error(f"unknown workload {name!r}; valid: {', '.join(WORKLOAD_NAMES)}")
    if "bench" in args.hf_workloads:
        p.error("--hf-workloads: bench has mixed lengths; transformers runs batch1, "
                "prefill_heavy, decode_heavy")
    if (args.nano_vllm is None) != (args.nano_vllm_runner is None):
        p.error("--nano-vllm and --nano-vllm-runner go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    _log(f"logs in {args.log_dir}")
    workloads = {n: build_workload(n, args.vocab) for n in args.workloads}
    report = gpu_report.new_report(args, workloads)
    fp8 = gpu_report.new_report(args, workloads) if args.fp8 else None  # --fp8's pass
    fp8_bytes: int | None = None
    stage = Stage(report, args.out)
    tmp = None if args.checkpoint_dir else Path(tempfile.mkdtemp(prefix="gpu-serving-ckpt-"))
    ckpt = args.checkpoint_dir or tmp
    assert ckpt is not None
    if args.device.startswith("cuda"):
        import torch

        report.power = PowerLog(torch.device(args.device).index or 0)
        report.power.start()
    try:
        report.weight_bytes = stage.run("checkpoint", prepare_checkpoint, args, ckpt)
        if report.weight_bytes is None:
            return 1
        report.copy_bw = stage.run("copy bandwidth", copy_bandwidth, args.device)
        ours = [w.head(args.limit_requests) for w in workloads.values()]
        if not args.skip_ours:
            stage.run("our server", bench_ours, args, ckpt, ours, report)
        if args.nano_vllm:
            records = stage.run("nano-vllm", run_nano_vllm, args.nano_vllm_runner,
                                args.nano_vllm, args.extra_site, ckpt, args.workloads,
                                args.log_dir / "nano-vllm.log", args.peer_timeout)
            for record in records or []:
                if record["workload"] in report.rows:
                    report.rows[record["workload"]].nano = record
            report.write(args.out)
        # after the peer: a run cut short by a time limit still has the bf16 ratios
        if fp8 is not None:
            fp8_bytes = fp8_compare.fp8_weight_bytes(ckpt)
            stage.run("our server, fp8", bench_ours, args, ckpt, ours, fp8,
                      tuple(fp8_compare.FP8_FLAGS), "server-fp8.log")
        if args.hf_workloads:
            hf = [build_workload(n, args.vocab).head(args.limit_requests)
                  for n in args.hf_workloads]
            runs = stage.run("transformers", run_transformers, ckpt, args.device, args.dtype,
                             hf, args.hf_max_batch, args.hf_max_requests)
            for run in runs or []:
                report.rows.setdefault(run.workload, Row(build_workload(
                    run.workload, args.vocab).head(args.limit_requests))).hf = run
    finally:
        if report.power is not None:
            report.power.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report.write(args.out)
    if fp8 is not None:
        text += fp8_compare.render(report, fp8, fp8_bytes)
        if args.out is not None:
            args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
