"""Where a load run's wall time went, from the router's log: each finished request's log
line (``router.engine.lifecycle``: ``request N success: ... queue_s=… ttft_s=… e2e_s=…``, stamped
when it finished) gives its arrival (finish − e2e) and its first token (arrival + ttft).

For a run of requests sent at once this separates how long the requests took to reach
the engine (HTTP, validation), the prefill phase (until the last first token) and the
decode phase after it (per step: its length over the most tokens a request generated,
less the first). An in-process peer (nano-vllm's runner adds every prompt at once) has
no arrival phase.

    python -m benchmarks.serving.request_timeline server.log   # every run in a log, split by gaps
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) .*request \d+ success: "
    r"prompt_tokens=\d+ generated_tokens=(?P<generated>\d+) .*ttft_s=(?P<ttft>[\d.]+) "
    r"e2e_s=(?P<e2e>[\d.]+)")


@dataclass(frozen=True)
class Finished:
    """One request, times in seconds since the epoch (the log's local clock)."""

    arrival: float
    first_token: float
    finish: float
    generated: int


@dataclass(frozen=True)
class Timeline:
    """A run's phases, seconds from its first arrival (``decode_step_s``: seconds per
    step after the last first token)."""

    requests: int
    arrivals_s: float
    last_first_token_s: float
    last_finish_s: float
    decode_step_s: float
    tok_s: float
    stalls_s: tuple[float, ...] = ()

    def describe(self) -> str:
        noun = "request" if self.requests == 1 else "requests"
        text = (f"{self.requests} {noun} reached the engine over {self.arrivals_s:.2f} s; "
                f"the last first token {self.last_first_token_s:.2f} s after the first "
                f"arrival, then {self.decode_step_s * 1e3:.2f} ms per decode step to the last "
                f"finish at {self.last_finish_s:.2f} s ({self.tok_s:,.0f} output tok/s "
                f"server-side)")
        if self.stalls_s:
            text += (f"; first tokens stopped for ≥ {STALL_S} s while requests waited "
                     f"{len(self.stalls_s)} times (longest {max(self.stalls_s):.2f} s)")
        return text


def read_finished(log: Path) -> list[Finished]:
    """Every successful request of ``log``, in arrival order (lines without a first token
    are left out)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        finish = datetime.datetime.strptime(match["stamp"], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        arrival = finish - float(match["e2e"])
        out.append(Finished(arrival, arrival + float(match["ttft"]), finish,
                            int(match["generated"])))
    return sorted(out, key=lambda f: f.arrival)


# A gap between first tokens this long, with requests waiting for theirs, is a stall: a
# step of the largest prefill budget (16384 tokens) takes ~0.4 s on an H100.
STALL_S = 0.45


def first_token_stalls(requests: list[Finished], least_s: float = STALL_S) -> list[float]:
    """Gaps of at least ``least_s`` seconds between consecutive first tokens of
    ``requests`` during which a request that had arrived was still waiting for its own
    (a step that took that long, or the engine stopped: a kernel compiling, say)."""
    firsts = sorted(requests, key=lambda r: r.first_token)
    gaps = []
    for before, after in itertools.pairwise(firsts):
        gap = after.first_token - before.first_token
        if gap >= least_s and after.arrival <= before.first_token:
            gaps.append(gap)
    return gaps


def late_compiles(log: Path) -> list[str]:
    """The kernels the shards' log says were compiled while serving
    (``shard/kernels/compile_watch.py``'s warning), in order."""
    return re.findall(r"Triton kernel (\S+) compiled while serving",
                      log.read_text(errors="replace"))


def timeline(requests: list[Finished]) -> Timeline | None:
    """The phases of ``requests`` (one run); None for none."""
    if not requests:
        return None
    start = requests[0].arrival
    last_first = max(r.first_token for r in requests) - start
    last_finish = max(r.finish for r in requests) - start
    steps = max(r.generated for r in requests) - 1
    return Timeline(
        requests=len(requests),
        arrivals_s=requests[-1].arrival - start,
        last_first_token_s=last_first,
        last_finish_s=last_finish,
        decode_step_s=(last_finish - last_first) / steps if steps > 0 else float("nan"),
        tok_s=sum(r.generated for r in requests) / max(last_finish, 1e-9),
        stalls_s=tuple(first_token_stalls(requests)),
    )


def between(requests: list[Finished], start: float, end: float) -> list[Finished]:
    """The requests that arrived and finished within ``[start, end]`` (epoch seconds; the
    log stamps to the millisecond, so the window is widened by that much)."""
    return [r for r in requests if start - 2e-3 <= r.arrival and r.finish <= end + 2e-3]


def split_runs(requests: list[Finished], gap_s: float = 1.0) -> list[list[Finished]]:
    """``requests`` (in arrival order) cut into runs wherever two arrivals are more than
    ``gap_s`` apart (a load generator sends a run's requests at once)."""
    runs: list[list[Finished]] = []
    for r in requests:
        if not runs or r.arrival - runs[-1][-1].arrival > gap_s:
            runs.append([])
        runs[-1].append(r)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="the server's log (stderr of shardserve launch)")
    p.add_argument("--gap", type=float, default=1.0,
                   help="seconds between two arrivals that separate two runs")
    args = p.parse_args()
    for run in split_runs(read_finished(args.log), args.gap):
        t = timeline(run)
        if t is not None:
            print(t.describe())


if __name__ == "__main__":
    main()
