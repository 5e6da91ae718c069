"""Where a decode step's time goes between the device and the router: reads the rows that
``router.step_trace`` and ``shard.step_trace`` wrote (a server run with
``--step-trace-dir``) and prints one table
of the hops of the host chain that must fit in one step of device time.

With one step in flight (``--steps-in-flight 1``; with two, read k+3 for k+2 below) the
router sends step k+2 once it has applied step k's tokens,
while the device computes step k+1 (launched earlier). So the chain

    ready(k) → answer(k) → recv(k) → applied(k) → send(k+2) → arrive(k+2) → launched(k+2)

runs beside step k+1 on the device, and the device waits whenever the chain is longer:
``idle = launched(k+2) − ready(k+1)`` when positive. ``ready`` is when the shard's host saw
step k's sampled ids, so it includes the wake-up of the waiting thread. Every point
carries the router's step number (the shard echoes it in its Decode response).

    python -m benchmarks.steps.step_chain TRACE_DIR [--min-size 200]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from benchmarks.harness import percentile


def hops(in_flight: int) -> list[tuple[str, str, int, str, int]]:
    """(name, from point, step offset, to point, step offset) of each hop, with
    ``in_flight`` steps sent ahead of the one being applied (the router's
    ``--steps-in-flight``): after applying step k it sends step k + 1 + in_flight."""
    n = 1 + in_flight
    return [
        ("shard: ready → answer (read ids, records, protobuf)", "ready", 0, "answer", 0),
        ("gRPC + router wake-up: answer → recv", "answer", 0, "recv", 0),
        ("router: recv → applied (tokens, stop checks)", "recv", 0, "applied", 0),
        (f"router: applied → send of step k+{n} (schedule, blocks, request)",
         "applied", 0, "send", n),
        ("gRPC + shard wake-up: send → arrive", "send", n, "arrive", n),
        ("shard: arrive → launched (turn, lock, thread, launch)", "arrive", n, "launched", n),
        (f"whole chain: ready(k) → launched(k+{n})", "ready", 0, "launched", n),
        ("device period: ready(k) → ready(k+1)", "ready", 0, "ready", 1),
        (f"device idle: launched(k+{n}) − ready(k+{n - 1}), when positive",
         "ready", n - 1, "launched", n),
    ]



def read_trace(folder: Path) -> tuple[dict[str, list[tuple[int, int, int]]], ...]:
    """(router points, shard points): point → [(step, ns, size)] in time order; the rank whose
    file comes first is the shard read."""
    processes = []
    for path in sorted(folder.glob("*.tsv")):
        points: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for line in path.read_text().splitlines():
            point, step, ns, size = line.split("\t")
            points[point].append((int(step), int(ns), int(size)))
        for rows in points.values():
            rows.sort(key=lambda row: row[1])
        processes.append(points)
    router = next(p for p in processes if "send" in p)
    shard = next(p for p in processes if "arrive" in p)
    return router, shard


def step_times(router: dict, shard: dict) -> dict[str, dict[int, int]]:
    """point → {step: ns}. A step number seen twice (the router counts again from 1
    after a failed step clears the shards' batches) keeps its latest time: trace one
    run without failures."""
    return {
        point: {step: ns for step, ns, _ in rows}
        for point, rows in {**router, **shard}.items()
    }


def hop_table(
    times: dict[str, dict[int, int]], sizes: dict[int, int], min_size: int, in_flight: int
) -> list[tuple[str, list[float]]]:
    """Each hop's durations (ms) over the decode steps k of at least ``min_size`` requests
    whose following steps up to the one sent after it are such steps too."""
    steps = sorted(k for k in times["answer"] if sizes.get(k, 0) >= min_size)
    decode = set(steps)
    rows = []
    for name, a, da, b, db in hops(in_flight):
        values = []
        for k in steps:
            if not set(range(k + 1, k + 2 + in_flight)) <= decode:
                continue
            t0, t1 = times[a].get(k + da), times[b].get(k + db)
            if t0 is None or t1 is None:
                continue
            value = (t1 - t0) / 1e6
            values.append(max(value, 0.0) if name.startswith("device idle") else value)
        rows.append((name, values))
    return rows


def idle_table(shard: dict[str, list[tuple[int, int, int]]]) -> list[str]:
    """The device's idle time before each step of the run, by the kind of step that
    followed it (``device_gap`` rows, µs; a step is a prefill when the shard marked it
    ``prefill``), as markdown lines: steps, total seconds, share of the traced span (the
    shard's first mark to its last), p50/p99/max ms."""
    prefills = {step for step, _, _ in shard.get("prefill", [])}
    gaps: dict[str, list[float]] = {"prefill": [], "decode": []}
    for step, _, us in shard.get("device_gap", []):
        gaps["prefill" if step in prefills else "decode"].append(us / 1e3)
    gaps["all"] = gaps["prefill"] + gaps["decode"]
    stamps = [ns for rows in shard.values() for _, ns, _ in rows]
    span_ms = (max(stamps) - min(stamps)) / 1e6 if stamps else float("nan")
    lines = [f"device idle before each step (CUDA events), traced span {span_ms / 1e3:.2f} s:",
             "", "| next step | steps | idle s | share of span | p50 ms | p99 ms | max ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, values in gaps.items():
        if not values:
            continue
        total = sum(values)
        lines.append(f"| {kind} | {len(values)} | {total / 1e3:.3f} | {total / span_ms:.2%} | "
                     f"{percentile(values, 50):.3f} | {percentile(values, 99):.3f} | "
                     f"{max(values):.3f} |")
    return lines


def pass_table(
    times: dict[str, dict[int, int]], sizes: dict[int, int], min_size: int,
    pause_s: float = 0.2, min_steps: int = 10,
) -> list[str]:
    """Per pass of the run (decode steps split where the router sent none for
    ``pause_s``, as between a benchmark's passes; passes of fewer than ``min_steps``
    chosen steps, such as warm-up requests, left out): over its steps of at least
    ``min_size`` requests, the device's idle time before them (``device_gap``), the mean
    forward, and the idle share, idle / (idle + forward), as markdown lines."""
    sends = sorted((ns, k) for k, ns in times["send"].items())
    passes: list[list[int]] = []
    last_ns = None
    for ns, k in sends:
        if last_ns is None or ns - last_ns > pause_s * 1e9:
            passes.append([])
        passes[-1].append(k)
        last_ns = ns
    lines = ["| pass | steps | device idle before them, s | p50 / p90 / p99 ms | mean forward ms "
             "| idle share |", "|---:|---:|---:|---|---:|---:|"]
    for number, steps in enumerate(passes, 1):
        chosen = [k for k in steps if sizes.get(k, 0) >= min_size
                  and k in times["device_gap"] and k in times["answer"]]
        if len(chosen) < min_steps:
            continue
        idle = [times["device_gap"][k] / 1e3 for k in chosen]
        forward = [times["answer"][k] / 1e3 for k in chosen]
        share = sum(idle) / (sum(idle) + sum(forward))
        lines.append(f"| {number} | {len(chosen)} | {sum(idle) / 1e3:.3f} | "
                     f"{percentile(idle, 50):.3f} / {percentile(idle, 90):.3f} / "
                     f"{percentile(idle, 99):.3f} | {sum(forward) / len(forward):.2f} | "
                     f"{share:.1%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--min-size", type=int, default=0,
                        help="only steps of at least this many requests (default: 90%% of "
                             "the largest step)")
    parser.add_argument("--max-size", type=int, default=0,
                        help="only steps of at most this many requests (0: no bound)")
    parser.add_argument("--steps-in-flight", type=int, default=1,
                        help="the router's --steps-in-flight in the traced run")
    args = parser.parse_args()
    router, shard = read_trace(args.trace_dir)
    print("\n".join(idle_table(shard)) + "\n")
    sizes = {step: size for step, _, size in router["send"]}
    if not sizes:
        raise SystemExit(f"no decode step in the trace of {args.trace_dir}")
    if args.max_size:
        sizes = {step: size for step, size in sizes.items() if size <= args.max_size}
        if not sizes:
            raise SystemExit(f"no decode step of at most {args.max_size} requests")
    min_size = args.min_size or int(0.9 * max(sizes.values()))
    print(f"decode steps of {min_size} to {max(sizes.values())} requests")
    times = step_times(router, shard)
    values = {point: {step: value for step, _, value in rows}
              for point, rows in shard.items() if point in ("device_gap", "answer")}
    print("\n".join(pass_table({"send": times["send"], **values}, sizes, min_size)) + "\n")
    rows = hop_table(times, sizes, min_size, args.steps_in_flight)
    period = [
        (times["recv"][k + 1] - times["recv"][k]) / 1e6 for k in times["recv"]
        if sizes.get(k, 0) >= min_size and sizes.get(k + 1, 0) >= min_size
        and k + 1 in times["recv"]
    ]
    rows.append(("router period: recv(k) → recv(k+1)", period))
    forward = {step: us for step, _, us in shard["answer"]}
    forward_ms = [forward[k] / 1e3 for k in forward if sizes.get(k, 0) >= min_size]
    rows.append(("shard forward (CUDA events around the step's kernels)", forward_ms))
    gaps = {step: us for step, _, us in shard.get("device_gap", [])}
    rows.append(("device gap before the step (CUDA events: end of k−1 → start of k)", [
        gaps[k] / 1e3 for k in gaps if sizes.get(k, 0) >= min_size
        and sizes.get(k - 1, 0) >= min_size
    ]))
    print("| hop | steps | p10 ms | p50 ms | p90 ms | mean ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in rows:
        mean = sum(values) / len(values) if values else float("nan")
        print(f"| {name} | {len(values)} | {percentile(values, 10):.3f} | "
              f"{percentile(values, 50):.3f} | {percentile(values, 90):.3f} | {mean:.3f} |")
    if period and forward_ms:
        share = 1 - (sum(forward_ms) / len(forward_ms)) / (sum(period) / len(period))
        print(f"\nrouter + gRPC share of the router's step period: {share:.1%} "
              "(1 − mean forward / mean period)")


if __name__ == "__main__":
    main()
