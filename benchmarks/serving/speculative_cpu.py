"""Speculative decoding on the CPU: output tokens/s with speculation off and on (n-gram
guesses, or a draft model's), over the HTTP API.

What is measured
----------------
The script starts ``shardserve launch --executor local`` on ``--model`` (the default
model, SmolLM2-135M-Instruct) without speculation (``off``), with ``--spec-args``
(``on``: by default ``--speculative-method ngram`` with its default lookahead and
n-gram lengths; ``--speculative-model DIR`` for a draft model, for example one written
by :mod:`benchmarks.serving.draft_checkpoint`) and with each ``--sweep`` configuration
(``;``-separated flags added to ``--spec-args``; a later flag overrides an earlier one,
so ``--speculative-model DIR`` swaps the draft), all at once, and sends them greedy
``POST /v1/chat/completions`` requests (temperature 0, ``max_tokens``
``--max-tokens``, EOS ends an answer) of two fixed prompt sets, each at batch 1 (one
request at a time) and batch 8 (8 in flight):

- **grounded**: summarize, extract from, edit, translate or rewrite a text given in the
  prompt, and rename or document identifiers of given code: the answer copies runs of
  its input, which prompt lookup guesses;
- **chat**: open questions with no source text, where guesses are mostly rejected and
  the policy (pausing requests of low acceptance) must keep the speed of decoding
  without speculation.

The servers take turns, one round at a time (a round: ``batch`` prompts, all in flight
at once; the order of the servers reversed every other round), so that the load of a
shared machine drifts alike over all of them; only the server whose turn it is works.
``off`` and ``on`` run every workload; the sweep's servers the ``--sweep-workloads``
(by default the grounded prompts at batch 1, the lookahead and n-gram lengths the
defaults are chosen from).

Per workload and server: output tokens/s = completion tokens / the rounds' wall time
(from a round's first request sent to its last answer); the acceptance rate (accepted /
proposed guesses) and the mean accepted guesses per verification (a request's verify
step with at least one guess), from the ``shardserve_spec_decode_*_total`` counters'
deltas at ``/metrics``; and how many answers are identical with and without
speculation, token for token (each answer's tokens as ``logprobs.content`` names them,
and its text). Beside them, from the step histograms' ``_sum`` / ``_count`` deltas: the
mean decode step without speculation and the mean speculative step's verify forward
and sampling with it (the shard's time; its proposal is timed apart), and the
tokens a decode step emits with speculation (an answer's first token comes from its
prefill and is not counted). Each server first answers one warm-up request; the batch-8
runs follow the batch-1 runs of the same prompts, so their prompts come from the prefix
cache (with speculation off and on alike).

What a speculative step costs (the table of step costs, batch-1 workloads): the router's
decode step period (``decode_step_wall_seconds``: the time between two decode results)
is measured on every server; on ``on`` it mixes plain steps (a paused request's) and
speculative ones, which are a share s = verify steps / decode steps of them, so a
speculative step's period (proposal, a draft's forward passes included, verify forward,
sampling and the router's work) is estimated as (period on - (1 - s) x period off) / s.
A speculative step pays when it emits more tokens than period spec / period off; the
acceptance that would give this many, with k guesses (the mean per verification,
rounded) each accepted independently, is solved from (1 - a^(k+1)) / (1 - a) (Leviathan
et al. 2023, eq. 1).

Usage: ``python -m benchmarks.serving.speculative_cpu [--max-tokens 128]
[--sweep "--num-speculative-tokens 2;--ngram-min 1"] [--out
benchmarks/results/speculative-cpu.md]``; a draft model:
``python -m benchmarks.serving.draft_checkpoint --layers 20 --out /tmp/draft-20`` then
``python -m benchmarks.serving.speculative_cpu --spec-args "--speculative-model
/tmp/draft-20" --sweep "--speculative-model /tmp/draft-8" --sweep-workloads grounded-1
chat-1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness import (
    free_port,
    header,
    start_server,
    stop_server,
    wait_healthy,
)
from benchmarks.steps.speculative_verify import expected_tokens

# ---- the prompts ---------------------------------------------------------------------------

_HARBOUR = (
    "The harbour of Port Ellen was built in 1821 by Walter Frederick Campbell, who named "
    "it after his wife, Lady Eleanor Campbell. For most of the nineteenth century the "
    "harbour served the distilleries of the south coast of Islay: barley arrived by boat "
    "from the mainland, and casks of whisky left the same way. In 1881 a new pier was "
    "added so that the steamer from Glasgow could call twice a week. The maltings that "
    "stand beside the harbour today opened in 1973 and supply malted barley to most of "
    "the island's distilleries. The ferry from Kennacraig still arrives at Port Ellen "
    "several times a day, carrying visitors, lorries and, in the autumn, the new crop of "
    "barley."
)

_MEETING = (
    "Minutes of the library committee, 14 March. Present: Anna Kowalski (chair), Tom "
    "Reyes, Priya Natarajan and Ben Okafor. Anna Kowalski opened the meeting at 7 pm. Tom "
    "Reyes reported that the roof repair will cost 12,400 euros and can start on 2 May. "
    "Priya Natarajan proposed opening the reading room on Sunday afternoons from June; the "
    "committee agreed. Ben Okafor will ask the town council for a grant of 5,000 euros "
    "before 30 April. The next meeting is on 11 April at 7 pm in the reading room."
)

_EMAIL = (
    "hey team, so the release is gonna slip again, sorry. the build server died on "
    "tuesday and we lost like two days getting it back. also the payment tests are still "
    "flaky and i dont want to ship with that. new date is friday the 21st, if nothing "
    "else breaks. can everyone pls check their open tickets and close the ones that are "
    "done? thx, sam"
)

_TYPOS = (
    "Our new office is located on the second floor of the old post office bulding, next "
    "to the train staton. Visiters should use the side enterance on Mill Street, because "
    "the main door is closed untill the renovation is finised. There is a small car park "
    "behind the bulding, but it is often full in the mornings, so we recomend coming by "
    "train or by bicycle. If you get lost, call the receptoin on 555 0142."
)

_STATS = """def stats(values):
    x = 0
    count = 0
    for v in values:
        x = x + v
        count = count + 1
    mean = x / count
    squares = 0
    for v in values:
        squares = squares + (v - mean) * (v - mean)
    return x, mean, squares / count"""

_INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}

    def add_item(self, name, quantity):
        if name in self.items:
            self.items[name] = self.items[name] + quantity
        else:
            self.items[name] = quantity

    def remove_item(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] = self.items[name] - quantity
        if self.items[name] <= 0:
            del self.items[name]

    def count(self, name):
        return self.items.get(name, 0)"""

_FETCH = """def get_data(url, retries):
    for attempt in range(retries):
        response = requests.get(url, timeout=10)
        if response.status_code == 200:
            return response.json()
        time.sleep(2 ** attempt)
    raise RuntimeError("get_data failed for " + url)


def get_users(base_url):
    return get_data(base_url + "/users", 3)


def get_orders(base_url):
    return get_data(base_url + "/orders", 5)"""

GROUNDED = [
    f"Summarize the following text in three sentences.\n\n{_HARBOUR}",
    f"List every person named in these minutes with the task or report that is theirs, "
    f"one line per person.\n\n{_MEETING}",
    f"Correct the spelling mistakes in this text and return the corrected text.\n\n{_TYPOS}",
    f"Rewrite this email in a polite, formal tone, keeping every fact.\n\n{_EMAIL}",
    f"Translate this text into French.\n\n{_HARBOUR}",
    f"Rename the variable x to total in this Python function and return the whole "
    f"function.\n\n```python\n{_STATS}\n```",
    f"Add a docstring to every method of this class and return the whole class.\n\n"
    f"```python\n{_INVENTORY}\n```",
    f"Rename the function get_data to fetch_json everywhere in this code and return the "
    f"whole code.\n\n```python\n{_FETCH}\n```",
]

CHAT = [
    "Why is the sky blue?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "What are the main differences between a cat and a dog as pets?",
    "Write a short poem about the sea in autumn.",
    "How do I make a good cup of tea?",
    "Explain what a computer programming language is to a child.",
    "What should I pack for a week of hiking in the mountains?",
    "Tell me a short story about a robot who learns to paint.",
]

PROMPT_SETS: dict[str, list[str]] = {"grounded": GROUNDED, "chat": CHAT}
WORKLOADS = ("grounded-1", "grounded-8", "chat-1", "chat-8")  # prompt set - batch
SWEEP_WORKLOAD = "grounded-1"


# ---- one workload's run --------------------------------------------------------------------

_COUNTER = re.compile(
    r"^shardserve_(spec_decode_(?:proposed_tokens|accepted_tokens|verifications)_total"
    r"|(?:decode_step|spec_decode_(?:verify|propose)_step)_duration_seconds_(?:sum|count)"
    r"|decode_step_wall_seconds_(?:sum|count)) (\S+)$"
)
COUNTERS = (
    "spec_decode_proposed_tokens_total",
    "spec_decode_accepted_tokens_total",
    "spec_decode_verifications_total",
    "decode_step_duration_seconds_sum",
    "decode_step_duration_seconds_count",
    "spec_decode_verify_step_duration_seconds_sum",
    "spec_decode_verify_step_duration_seconds_count",
    "spec_decode_propose_step_duration_seconds_sum",
    "spec_decode_propose_step_duration_seconds_count",
    "decode_step_wall_seconds_sum",
    "decode_step_wall_seconds_count",
)


def spec_counters(text: str) -> dict[str, float]:
    """The :data:`COUNTERS` of a Prometheus exposition, keyed without the
    ``shardserve_`` prefix (absent ones are 0): the speculation counters and the
    ``_sum`` / ``_count`` of the decode, verify and propose step histograms and of the
    router's decode step period (seconds)."""
    found = dict.fromkeys(COUNTERS, 0.0)
    found.update({m[1]: float(m[2]) for line in text.splitlines() if (m := _COUNTER.match(line))})
    return found


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


@dataclass
class Answer:
    """One request's answer: its ``tokens`` (as ``logprobs.content`` names them) and
    ``text``."""

    tokens: list[str]
    text: str


@dataclass
class Run:
    """One workload on one server.

    Attributes:
        seconds: wall time from the first request sent to the last answer.
        answers: per prompt, in the prompt set's order.
        counters: the :data:`COUNTERS`' deltas over the run.
    """

    seconds: float
    answers: list[Answer] = field(default_factory=list)
    counters: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))

    @property
    def tokens(self) -> int:
        return sum(len(a.tokens) for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.tokens, self.seconds)

    @property
    def acceptance(self) -> float:
        """Accepted / proposed guesses; NaN when none was proposed."""
        c = self.counters
        return _ratio(
            c["spec_decode_accepted_tokens_total"], c["spec_decode_proposed_tokens_total"]
        )

    @property
    def accepted_per_verification(self) -> float:
        """Mean accepted guesses per verification; NaN when none ran."""
        c = self.counters
        return _ratio(c["spec_decode_accepted_tokens_total"], c["spec_decode_verifications_total"])

    @property
    def decode_step_ms(self) -> float:
        """Mean shard time of a decode step (speculative steps, their proposal
        included), ms."""
        c = self.counters
        return 1e3 * _ratio(
            c["decode_step_duration_seconds_sum"], c["decode_step_duration_seconds_count"]
        )

    @property
    def verify_step_ms(self) -> float:
        """Mean shard time of a speculative step's verify forward and sampling (its
        proposal apart), ms; NaN when none ran."""
        c = self.counters
        return 1e3 * _ratio(
            c["spec_decode_verify_step_duration_seconds_sum"],
            c["spec_decode_verify_step_duration_seconds_count"],
        )

    @property
    def propose_ms(self) -> float:
        """Mean shard time of a speculative step's guesses (a draft model's forward
        passes, n-gram lookups), ms; NaN when none ran."""
        c = self.counters
        return 1e3 * _ratio(
            c["spec_decode_propose_step_duration_seconds_sum"],
            c["spec_decode_propose_step_duration_seconds_count"],
        )

    @property
    def tokens_per_step(self) -> float:
        """Tokens after each answer's first (a prefill's) per decode step."""
        steps = self.counters["decode_step_duration_seconds_count"]
        return _ratio(self.tokens - len(self.answers), steps)

    @property
    def step_period_ms(self) -> float:
        """Mean decode step period seen by the router (verify steps included), ms."""
        c = self.counters
        return 1e3 * _ratio(c["decode_step_wall_seconds_sum"], c["decode_step_wall_seconds_count"])

    @property
    def speculating(self) -> float:
        """Share of the decode steps that verified guesses (0 without speculation)."""
        c = self.counters
        return _ratio(
            c["spec_decode_verify_step_duration_seconds_count"],
            c["decode_step_duration_seconds_count"],
        )

    @property
    def proposed_per_verification(self) -> float:
        """Mean guesses proposed per verification; NaN when none ran."""
        c = self.counters
        return _ratio(c["spec_decode_proposed_tokens_total"], c["spec_decode_verifications_total"])


def split_workload(workload: str) -> tuple[list[str], int]:
    """(prompts, batch) of a workload named ``set-batch``."""
    prompt_set, batch = workload.rsplit("-", 1)
    return PROMPT_SETS[prompt_set], int(batch)


@dataclass
class Server:
    """A server started for the run: its ``label`` in the tables (``off``, ``on`` or a
    sweep's flags), its launch ``flags``, its ``base`` URL and its child process."""

    label: str
    flags: list[str]
    base: str
    proc: subprocess.Popen[bytes]
    log_path: Path


async def _ask(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> Answer:
    response = await client.post(
        f"{base}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
        },
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return Answer(
        [t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"] or ""
    )


async def run_workload(
    client: httpx.AsyncClient,
    servers: Sequence[Server],
    workload: str,
    max_tokens: int,
    first_round: int = 0,
    repeat: int = 1,
) -> dict[str, Run]:
    """Run ``workload`` (``set-batch``; its prompts ``repeat`` times) on each of
    ``servers``, interleaved: in rounds of ``batch`` prompts (all in flight at once),
    each round on one server after the other, in the servers' order in even rounds
    (counted from ``first_round``) and the reverse in odd ones, so that the machine's
    load drifts alike over all of them.

    Returns:
        label -> its run: the rounds' seconds summed, the answers in prompt order and
        the counters' deltas over the workload.
    """
    prompts, batch = split_workload(workload)
    prompts = prompts * repeat

    async def counters() -> list[dict[str, float]]:
        return [spec_counters((await client.get(f"{s.base}/metrics")).text) for s in servers]

    before = await counters()
    seconds = [0.0] * len(servers)
    answers: list[list[Answer]] = [[] for _ in servers]
    for r, first in enumerate(range(0, len(prompts), batch)):
        chunk = prompts[first : first + batch]
        order = list(range(len(servers)))
        for i in order if (first_round + r) % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            got = await asyncio.gather(
                *(_ask(client, servers[i].base, p, max_tokens) for p in chunk)
            )
            seconds[i] += time.perf_counter() - start
            answers[i].extend(got)
    after = await counters()
    return {
        s.label: Run(seconds[i], answers[i], {k: after[i][k] - before[i][k] for k in COUNTERS})
        for i, s in enumerate(servers)
    }


def start_servers(
    args: argparse.Namespace, flags: Mapping[str, list[str]], env: Mapping[str, str]
) -> list[Server]:
    """Start a server per label -> launch flags, all at once, and wait until each is
    healthy (stopping all of them if one fails).

    Raises:
        ServerError: a server exited or did not become healthy in time.
    """
    servers = []
    for label, extra in flags.items():
        log_path = Path(tempfile.mkdtemp()) / "server.log"
        port = free_port()
        proc = start_server(port, args.model, ["--device", args.device, *extra], log_path, env)
        servers.append(Server(label, extra, f"http://127.0.0.1:{port}", proc, log_path))
    try:
        for s in servers:
            wait_healthy(s.proc, s.base, s.log_path, args.startup_timeout)
    except BaseException:
        for s in servers:
            stop_server(s.proc)
        raise
    return servers


async def run_all(
    servers: Sequence[Server],
    workloads: Sequence[str],
    sweep_workloads: Sequence[str],
    max_tokens: int,
    repeat: int = 1,
) -> dict[str, dict[str, Run]]:
    """Warm each server up with one request, then run each of ``workloads`` on the
    ``off`` and ``on`` servers, and those of them in ``sweep_workloads`` on the others as
    well.

    Returns:
        label -> workload -> run.
    """
    runs: dict[str, dict[str, Run]] = {s.label: {} for s in servers}
    rounds = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await asyncio.gather(*(_ask(client, s.base, "Say hello.", 16) for s in servers))
        for workload in workloads:
            taking = [s for s in servers if s.label in ("off", "on") or workload in sweep_workloads]
            done = await run_workload(client, taking, workload, max_tokens, rounds, repeat)
            prompts, batch = split_workload(workload)
            rounds += -(-len(prompts) * repeat // batch)
            for label, run in done.items():
                runs[label][workload] = run
                print(
                    f"  {label} {workload}: {run.tokens} tokens in {run.seconds:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


# ---- the tables ----------------------------------------------------------------------------


def identical(off: Run, on: Run) -> int:
    """Answers equal token for token (and in text) with and without speculation."""
    return sum(
        a.tokens == b.tokens and a.text == b.text
        for a, b in zip(off.answers, on.answers, strict=True)
    )


def _spec_cells(off: Run, on: Run) -> str:
    """on/off | acceptance | accepted / verification | verify step | tokens / step |
    identical."""
    return (
        f"{on.tokens_per_s / off.tokens_per_s:.2f}× | {on.acceptance:.2f} "
        f"| {on.accepted_per_verification:.2f} | {on.verify_step_ms:.1f} "
        f"| {on.tokens_per_step:.2f} | {identical(off, on)}/{len(off.answers)}"
    )


_SPEC_HEADS = "| on/off | acceptance | accepted / verification | verify step on (ms) "
_SPEC_HEADS += "| tokens / decode step on | identical |"


def speculative_period_ms(off: Run, on: Run) -> float:
    """A speculative step's period on ``on`` (ms; proposal, verify forward, sampling and
    the router's work), its plain steps' period taken as ``off``'s: (period on - (1 - s)
    x period off) / s, s = the share of ``on``'s decode steps that speculated; NaN when
    none did."""
    share = on.speculating
    if not share > 0:
        return float("nan")
    return (on.step_period_ms - (1 - share) * off.step_period_ms) / share


def acceptance_for(tokens: float, k: int) -> float:
    """The acceptance a at which a verification of ``k`` guesses, each accepted
    independently with probability a, emits ``tokens`` tokens on average:
    (1 - a^(k+1)) / (1 - a) = tokens (Leviathan et al. 2023, eq. 1), solved by
    bisection. 0.0 when ``tokens`` <= 1; NaN when ``tokens`` > k + 1 (no acceptance
    emits that many) or is NaN."""
    if tokens <= 1.0:
        return 0.0
    if not tokens <= k + 1.0:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, k) < tokens else (low, mid)
    return (low + high) / 2


def cost_table(off: Mapping[str, Run], configs: Mapping[str, Mapping[str, Run]]) -> list[str]:
    """Markdown rows: per batch-1 workload and speculation config (label -> workload ->
    run), what a speculative step costs against a plain one and the tokens it must emit
    (and the acceptance that would emit them) to pay."""
    lines = [
        "| prompts | speculation | guesses / verification | steps speculating "
        "| decode step off (ms) | period off (ms) | propose on (ms) | verify step on (ms) "
        "| speculative period (ms) | tokens / speculative step | needed | acceptance "
        "| needed acceptance |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, base in off.items():
        prompt_set, batch = name.rsplit("-", 1)
        if batch != "1":
            continue
        for label, runs in configs.items():
            if name not in runs:
                continue
            run = runs[name]
            period = speculative_period_ms(base, run)
            needed = period / base.step_period_ms
            guesses = run.proposed_per_verification
            k = round(guesses) if guesses == guesses else 0
            flags = label if label.startswith("(") else f"`{label}`"
            lines.append(
                f"| {prompt_set} | {flags} | {guesses:.2f} | {run.speculating:.0%} "
                f"| {base.decode_step_ms:.1f} | {base.step_period_ms:.1f} "
                f"| {run.propose_ms:.1f} | {run.verify_step_ms:.1f} | {period:.1f} "
                f"| {1 + run.accepted_per_verification:.2f} | {needed:.2f} "
                f"| {run.acceptance:.2f} | {_or_none(acceptance_for(needed, k))} |"
            )
    return lines


def _or_none(acceptance: float) -> str:
    return "none" if acceptance != acceptance else f"{acceptance:.2f}"


def workload_table(off: Mapping[str, Run], on: Mapping[str, Run]) -> list[str]:
    """Markdown rows: per workload, speculation off against on."""
    lines = [
        "| prompts | batch | output tokens | off tok/s | on tok/s | decode step off (ms) "
        + _SPEC_HEADS,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in off:
        prompt_set, batch = name.rsplit("-", 1)
        a, b = off[name], on[name]
        lines.append(
            f"| {prompt_set} | {batch} | {a.tokens} | {a.tokens_per_s:.1f} "
            f"| {b.tokens_per_s:.1f} | {a.decode_step_ms:.1f} | {_spec_cells(a, b)} |"
        )
    return lines


def sweep_table(off: Run, configs: Mapping[str, Run]) -> list[str]:
    """Markdown rows: one workload under each speculation config (``configs``: its
    launch flags -> its run)."""
    lines = [
        "| speculation flags | tok/s " + _SPEC_HEADS,
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| (off: decode step {off.decode_step_ms:.1f} ms) | {off.tokens_per_s:.1f} "
        f"| 1.00× | - | - | - | {off.tokens_per_step:.2f} | - |",
    ]
    for flags, run in configs.items():
        label = flags if flags.startswith("(") else f"`{flags}`"
        lines.append(f"| {label} | {run.tokens_per_s:.1f} | {_spec_cells(off, run)} |")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    cache = Path(os.environ.get("SHARDSERVE_CACHE_DIR", Path.home() / ".cache" / "shardserve"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(cache / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="prompt set and batch of each run",
    )
    p.add_argument("--server-args", default="", help="launch flags of every server")
    p.add_argument(
        "--spec-args",
        default="--speculative-method ngram",
        help="launch flags that turn speculation on",
    )
    p.add_argument(
        "--sweep",
        default="--num-speculative-tokens 2;--num-speculative-tokens 5;--ngram-min 1",
        help="';'-separated flags added to --spec-args, a server each, run on "
        "--sweep-workloads ('' for none)",
    )
    p.add_argument(
        "--sweep-workloads",
        nargs="+",
        choices=WORKLOADS,
        default=[SWEEP_WORKLOAD],
        help="the workloads the sweep's servers run (those of --workloads)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of the servers (default: torch's own choice)",
    )
    p.add_argument("--repeat", type=int, default=1,
                   help="run each workload's prompts this many times (at batch 8 a workload "
                        "is one round per server: more rounds, alternating, average the "
                        "machine's drifting load)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    p.add_argument(
        "--answers",
        type=Path,
        default=None,
        help="write every answer's text, off and on, here (JSON)",
    )
    return p.parse_args(argv)


def method(spec_args: str) -> str:
    """What the speculation flags guess with, in words: a draft model (its folder's
    name; the last ``--speculative-model`` given) or n-gram guesses."""
    flags = shlex.split(spec_args)
    drafts = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--speculative-model"]
    return f"draft model {Path(drafts[-1]).name}" if drafts else "n-gram guesses"


def report(
    args: argparse.Namespace,
    off: Mapping[str, Run],
    on: Mapping[str, Run],
    sweep: Mapping[str, Mapping[str, Run]],
) -> str:
    """The markdown report: heading, setting, the workload table, the sweep's (one per
    workload the sweep ran; ``sweep``: its flags -> workload -> run) and the table of
    step costs."""
    launch = f"shardserve launch --executor local {args.server_args}".strip()
    lines = [
        header(f"Speculative decoding, {method(args.spec_args)}", args.device, "torch"),
        "",
        f"`{Path(args.model).name}`, `{launch}` against `{args.spec_args}`; "
        f"greedy `/v1/chat/completions`, max_tokens {args.max_tokens}, EOS ends an "
        f"answer; {len(GROUNDED)} grounded and {len(CHAT)} chat prompts per workload; "
        "the servers run side by side and take turns (a request at batch 1, all 8 at batch "
        "8).",
        "",
        *workload_table(off, on),
    ]
    for name in off:
        configs = {label: runs[name] for label, runs in sweep.items() if name in runs}
        if not configs:
            continue
        prompt_set, batch = name.rsplit("-", 1)
        lines += [
            "",
            f"{prompt_set.capitalize()} prompts at batch {batch} by speculation flags (added "
            f"to `{args.spec_args}`):",
            "",
            *sweep_table(off[name], {"(defaults)": on[name], **configs}),
        ]
    costs = cost_table(off, {"(defaults)": on, **sweep})
    if len(costs) > 2:
        lines += [
            "",
            "What a speculative step costs at batch 1 (period: the router's decode step "
            "period; a speculative step's estimated from the share of steps that "
            "speculated; needed: the tokens a speculative step must emit to pay, its "
            "period / the period off; needed acceptance: the acceptance that would emit "
            "them with the guesses per verification, each accepted independently):",
            "",
            *costs,
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = {"RAY_AUTH_MODE": "disabled"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    common = shlex.split(args.server_args)
    spec = shlex.split(args.spec_args)
    flags = {"off": common, "on": [*common, *spec]}
    sweep_workloads = [w for w in args.sweep_workloads if w in args.workloads]
    if sweep_workloads:
        for config in filter(None, (c.strip() for c in args.sweep.split(";"))):
            flags[config] = [*common, *spec, *shlex.split(config)]
    servers = start_servers(args, flags, env)
    try:
        runs = asyncio.run(run_all(servers, args.workloads, sweep_workloads, args.max_tokens,
                                   args.repeat))
    finally:
        for s in servers:
            stop_server(s.proc)
    off, on = runs.pop("off"), runs.pop("on")
    text = report(args, off, on, runs)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.answers:
        args.answers.write_text(
            json.dumps(
                {
                    name: {
                        "off": [a.text for a in off[name].answers],
                        "on": [a.text for a in on[name].answers],
                    }
                    for name in off
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
