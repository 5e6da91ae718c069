"""The peers of benchmarks/serving/gpu_serving.py, on the same checkpoint and workloads:

* nano-vllm, through its runner script (``nano_vllm_bench.py``, kept outside the project)
  in a subprocess; the runner prints one JSON line per workload.
* Hugging Face ``transformers`` ``generate``: static batches, greedy, sdpa attention,
  ``min_new_tokens = max_new_tokens`` so that EOS cannot end a row early.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import tail
from benchmarks.serving.workloads import Workload


class PeerError(RuntimeError):
    """A peer failed; the message ends with the tail of its log."""


def run_nano_vllm(runner: Path, nano_vllm: Path, extra_site: str | None, model: Path,
                  workloads: list[str], log_path: Path, timeout: float) -> list[dict]:
    """Run the nano-vllm runner on ``model``; its JSON lines (one dict per workload, keys
    ``workload``, ``requests``, ``output_tokens``, ``seconds``, ``output_tok_per_s``),
    each with ``ended_at`` added: ``time.time()`` when the line was read (the runner
    flushes each line as its workload ends).

    ``PYTHONPATH`` = ``extra_site`` (where flash-attn is installed) : ``nano_vllm`` : the
    current ``PYTHONPATH``. stderr goes to ``log_path``, stdout to ``log_path`` with the
    suffix ``.stdout``.

    Raises:
        PeerError: non-zero exit or timeout (with the log tail).
    """
    path = [p for p in (extra_site, str(nano_vllm), os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, str(runner), "--model", str(model), "--workloads", ",".join(workloads)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stamped: list[tuple[float, str]] = []
    with open(log_path, "wb") as log:
        # its own process group, so that a timeout also ends the runner's children
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                                errors="replace", start_new_session=True)
        reader = threading.Thread(target=_stamp_lines, args=(proc, stamped), daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as error:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise PeerError(f"nano-vllm timed out after {timeout:.0f}s:\n{tail(log_path)}") \
                from error
        finally:
            reader.join(timeout=10)
    log_path.with_suffix(".stdout").write_text("".join(line for _, line in stamped))
    if returncode != 0:
        raise PeerError(f"nano-vllm exited with {returncode}:\n{tail(log_path)}")
    results = []
    for ended_at, line in stamped:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "workload" in record:
            results.append({**record, "ended_at": ended_at})
    return results


def _stamp_lines(proc: subprocess.Popen[str], into: list[tuple[float, str]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append((time.time(), line))


@dataclass(frozen=True)
class HFRun:
    """``generate`` over one workload: requests run, batch size, tokens and seconds."""

    workload: str
    requests: int
    batch_size: int
    output_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def run_transformers(model_dir: Path, device: str, dtype: str, workloads: list[Workload],
                     max_batch: int, max_requests: int) -> list[HFRun]:
    """Time ``generate`` on each workload (uniform lengths only: no padding), in static
    batches of at most ``max_batch`` requests, over its first ``max_requests`` requests
    (0 = all). One warm-up batch of 2 × 16 tokens first. Output tokens/s = batch ×
    max_new_tokens summed over batches / summed ``generate`` wall time (prefill included).

    Raises:
        ValueError: a workload with mixed prompt or output lengths.
    """
    import torch
    from transformers import AutoModelForCausalLM

    for w in workloads:
        if not w.uniform:
            raise ValueError(f"transformers runs workloads of uniform lengths; {w.name} is not")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = model.to(device).eval()  # type: ignore[arg-type]  # .to is wrapped untyped
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def generate(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts, device=device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0)
        sync()
        assert out.shape == (len(prompts), ids.shape[1] + n), f"generate gave {out.shape}"
        return time.perf_counter() - t0

    generate([list(range(100, 132))] * 2, 16)
    runs = []
    for w in workloads:
        w = w.head(max_requests)
        seconds = 0.0
        batch = min(max_batch, len(w.prompts))
        for i in range(0, len(w.prompts), batch):
            seconds += generate(w.prompts[i:i + batch], w.output_lens[0])
        runs.append(HFRun(w.name, len(w.prompts), batch, w.output_tokens, seconds))
        print(f"transformers {w.name}: {runs[-1].tok_s:.1f} tok/s", file=sys.stderr)
    return runs
