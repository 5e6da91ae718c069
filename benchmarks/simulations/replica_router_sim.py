"""The replica router (router/serve/affinity.py's ReplicaChooser, the code
``shardserve serve`` runs) over 8-64 simulated replicas at 1,000+ requests/s: prefix
cache hit rate, load imbalance and routing cost per request, for affinity,
round-robin and least-loaded. No model, no Ray: a discrete-event simulation.

Trace: synthetic, with the shape of the Mooncake conversation trace (Qin et al.,
"Mooncake: A KVCache-centric Architecture for Serving LLM Chatbot", FAST 2025; the
trace in github.com/kvcache-ai/Mooncake lists per request its arrival, input and
output lengths and the hash ids of its prompt's blocks): Poisson arrivals; requests
are turns of sessions, each turn's prompt the previous turn's prompt + answer + a new
user message; sessions open with one of a few long shared system prompts. The lengths
here are this script's own parameters (flags), not the trace's numbers.

Replicas: each serves requests concurrently; a request holds its replica for
``prefill tokens computed / --prefill-rate + output tokens x --tpot``; a replica's
prefix cache is an LRU of ``--cache-blocks`` blocks holding prompts and answers (its
true content, which the router's index, of prompts only, estimates). Load imbalance:
the busiest replica's summed service time over the mean replica's.

    python -m benchmarks.simulations.replica_router_sim \
        --out benchmarks/results/replica-routing-cpu.md
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import header, percentile
from router.serve.affinity import PrefixIndex, ReplicaChooser, RouteHint

BLOCK = 16  # tokens per block


@dataclass
class Session:
    system: int
    blocks: list[int] = field(default_factory=list)  # the prompt's block ids so far
    turns: int = 0


# (arrival s, session id, prompt block ids, output tokens, answer block ids)
Request = tuple[float, int, list[int], int, list[int]]


class Trace:
    """Requests of the shape above (:data:`Request`)."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.rng = random.Random(seed)
        self.args = args
        self.sessions: dict[int, Session] = {}
        self.next_id = 0
        self.next_block = 1 << 40
        sys_blocks = args.system_tokens // BLOCK
        self.system_chains = [[(k << 20) | i for i in range(sys_blocks)]
                              for k in range(args.system_prompts)]

    def _new_blocks(self, tokens: int) -> list[int]:
        count = max(1, tokens // BLOCK)
        first, self.next_block = self.next_block, self.next_block + count
        return list(range(first, first + count))

    def requests(self, rate: float, seconds: float) -> list[Request]:
        out, now, rng, args = [], 0.0, self.rng, self.args
        while now < seconds:
            now += rng.expovariate(rate)
            live = [s for s, v in self.sessions.items() if v.turns < args.max_turns]
            if not live or rng.random() < args.new_session_rate or len(live) < args.min_live:
                session = Session(system=rng.randrange(args.system_prompts))
                session.blocks = list(self.system_chains[session.system])
                self.sessions[self.next_id] = session
                sid, self.next_id = self.next_id, self.next_id + 1
            else:
                sid = rng.choice(live)
                session = self.sessions[sid]
            user = int(rng.lognormvariate(4.5, 0.8))  # ~90 tokens median, long tail
            session.blocks += self._new_blocks(user)
            output = int(rng.lognormvariate(5.0, 0.7))  # ~150 tokens median
            answer = self._new_blocks(output)
            out.append((now, sid, list(session.blocks), output, answer))
            session.blocks += answer  # the answer joins the history
            session.turns += 1
            if session.turns >= args.max_turns:
                del self.sessions[sid]
        return out


def simulate(policy: str, replicas: int, trace: list[Request],
             args: argparse.Namespace) -> dict[str, float]:
    chooser = ReplicaChooser(policy=policy, max_gap=args.max_gap,
                             index=PrefixIndex(default_capacity=args.cache_blocks))
    names = [f"r{i}" for i in range(replicas)]
    chooser.set_replicas(names)
    caches: dict[str, OrderedDict[int, None]] = {n: OrderedDict() for n in names}
    busy = dict.fromkeys(names, 0.0)
    ends: list[tuple[float, str]] = []
    prompt = hit = 0
    cost: list[float] = []
    for n, (now, sid, blocks, output, answer) in enumerate(trace):
        while ends and ends[0][0] <= now:
            chooser.completed(heapq.heappop(ends)[1])
        hint = RouteHint(tuple(blocks), f"s{sid}")  # type: ignore[arg-type]
        started = time.perf_counter()
        decision = chooser.choose(names, hint)
        chooser.routed(decision.replica, hint, f"q{n}")
        cost.append(time.perf_counter() - started)
        cache = caches[decision.replica]
        cached = 0
        for block in blocks:
            if block not in cache:
                break
            cached += 1
        for block in reversed(blocks + answer):  # the answer is cached too; head most
            cache[block] = None  # recent, as the replica frees
            cache.move_to_end(block)
        while len(cache) > args.cache_blocks:
            cache.popitem(last=False)
        prompt += len(blocks)
        hit += cached
        service = (len(blocks) - cached) * BLOCK / args.prefill_rate + output * args.tpot
        busy[decision.replica] += service
        heapq.heappush(ends, (now + service, f"q{n}"))
    mean_busy = sum(busy.values()) / replicas
    return {"hit": hit / prompt, "computed": (prompt - hit) * BLOCK,
            "imbalance": max(busy.values()) / mean_busy,
            "cost_p50_us": percentile(cost, 50) * 1e6, "cost_p99_us": percentile(cost, 99) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--new-session-rate", type=float, default=0.2)
    parser.add_argument("--min-live", type=int, default=2000, help="sessions kept open")
    parser.add_argument("--cache-blocks", type=int, default=20000, help="per replica")
    parser.add_argument("--prefill-rate", type=float, default=20000.0, help="tokens/s")
    parser.add_argument("--tpot", type=float, default=0.02, help="seconds per output token")
    parser.add_argument("--max-gap", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trace = Trace(args, seed=0).requests(args.rate, args.seconds)
    rows = ["| replicas | policy | hit rate | prefill tokens computed | vs round-robin | "
            "load imbalance (max/mean) | routing µs p50 | routing µs p99 |",
            "|---|---|---|---|---|---|---|---|"]
    for replicas in args.replicas:
        results = {p: simulate(p, replicas, trace, args)
                   for p in ("affinity", "round_robin", "least_loaded")}
        for policy, r in results.items():
            ratio = r["computed"] / results["round_robin"]["computed"]
            rows.append(f"| {replicas} | {policy} | {r['hit']:.1%} | {r['computed']:.3g} | "
                        f"{ratio:.2f}x | {r['imbalance']:.2f} | {r['cost_p50_us']:.0f} | "
                        f"{r['cost_p99_us']:.0f} |")
    text = (f"{header('replica router simulation', 'cpu')}\n\n"
            f"{len(trace)} requests over {args.seconds:g} s ({args.rate:g}/s), "
            f"{args.system_prompts} system prompts of {args.system_tokens} tokens, up to "
            f"{args.max_turns} turns per session, {args.cache_blocks} cached blocks per "
            f"replica, prefill {args.prefill_rate:g} tok/s, TPOT {args.tpot * 1e3:g} ms\n\n"
            + "\n".join(rows) + "\n")
    print(text)
    if args.out:
        with args.out.open("a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
