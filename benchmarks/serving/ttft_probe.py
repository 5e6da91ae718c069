"""Time to first token of one request at a time, streaming against non-streaming, on a
server of its own: a diagnostic for ``gpu_serving.py``'s batch-1 TTFT (its streaming
pass measured 31-43 ms on H100s and H200s, while the engine logged 17 ms for the
non-streaming request of the same shape just before).

Starts ``shardserve launch --executor local`` on ``--model`` with ``--server-args``, then
for ``--rounds`` rounds sends one non-streaming and one streaming ``/v1/completions``
request (``--prompt-len`` token ids, fresh ones each request so that the prefix cache
serves none, ``--max-tokens`` tokens, greedy, ``ignore_eos``), one after the other, each
through the load client of ``gpu_serving.py`` (connections opened first, ``/metrics``
read before and after), ``--gap`` seconds apart. Prints the engine's TTFT per request
(``ttft_s`` of its log line) and the client's for the streaming ones: p50 and max.

    python -m benchmarks.serving.ttft_probe --model PATH --device cuda --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import free_port, start_server, stop_server, wait_healthy
from benchmarks.serving.completions_load import run_load
from benchmarks.serving.workloads import Workload

FINISHED = re.compile(r"request (\d+) success: prompt_tokens=(\d+) .*ttft_s=([0-9.]+)")


def engine_ttfts(log_path: Path, prompt_len: int) -> list[float]:
    """The engine's ``ttft_s`` of every finished request of ``prompt_len`` prompt tokens,
    by request id."""
    found = [(int(m[1]), float(m[3])) for m in FINISHED.finditer(log_path.read_text())
             if int(m[2]) == prompt_len]
    return [ttft for _, ttft in sorted(found)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--server-args", default="", help="more launch flags, one string")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gap", type=float, default=0.2, help="seconds between requests")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--log", type=Path, default=None, help="server log (default: a temp file)")
    args = p.parse_args()

    log_path = args.log or Path(tempfile.mkdtemp()) / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    flags = ["--device", args.device, *args.server_args.split()]
    proc = start_server(port, args.model, flags, log_path)
    rng = random.Random(0)
    client: dict[bool, list[float]] = {False: [], True: []}
    order: list[bool] = []
    try:
        wait_healthy(proc, base, log_path, timeout=900)
        for _ in range(args.rounds + 1):  # the first round warms up and is left out
            for stream in (False, True):
                prompt = [rng.randrange(1, args.vocab) for _ in range(args.prompt_len)]
                run = asyncio.run(run_load(base, Workload("probe", [prompt],
                                                          [args.max_tokens]), 1, stream))
                order.append(stream)
                if stream:
                    client[True].extend(run.ttft)
                time.sleep(args.gap)
        time.sleep(0.5)  # the last request's log line
    finally:
        stop_server(proc)
    engine = engine_ttfts(log_path, args.prompt_len)
    if len(engine) != len(order):
        print(f"error: {len(engine)} finished requests in {log_path}, {len(order)} sent",
              file=sys.stderr)
        return 1
    by_mode: dict[bool, list[float]] = {False: [], True: []}
    for stream, ttft in list(zip(order, engine, strict=True))[2:]:
        by_mode[stream].append(ttft)
    client[True] = client[True][1:]
    print(f"TTFT, {args.rounds} rounds, prompt {args.prompt_len} ids, {args.max_tokens} "
          f"tokens, {args.gap} s apart; server: {args.server_args or '(defaults)'}\n")
    print("| request | engine TTFT p50 / max (ms) | client TTFT p50 / max (ms) |")
    print("|---|---:|---:|")
    for stream in (False, True):
        e = by_mode[stream]
        c = f"{statistics.median(client[True]) * 1e3:.1f} / {max(client[True]) * 1e3:.1f}" \
            if stream else "-"
        print(f"| {'streaming' if stream else 'non-streaming'} | "
              f"{statistics.median(e) * 1e3:.1f} / {max(e) * 1e3:.1f} | {c} |")
    print(f"\nserver log: {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
