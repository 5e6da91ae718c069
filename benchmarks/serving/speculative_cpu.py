"""Speculative decoding with n-gram guesses on the CPU: output tokens/s with speculation
off and on, over the HTTP API.

What is measured
----------------
The script starts ``shardserve launch --executor local`` on ``--model`` (the default
model, SmolLM2-135M-Instruct) once without speculation and once with ``--spec-args``
(``--speculative-method ngram``: its default lookahead and n-gram lengths), and sends
greedy ``POST /v1/chat/completions`` requests (temperature 0, ``max_tokens``
``--max-tokens``, EOS ends an answer) of two fixed prompt sets, each at batch 1 (one
request at a time) and batch 8 (8 in flight):

- **grounded**: summarize, extract from, edit, translate or rewrite a text given in the
  prompt, and rename or document identifiers of given code: the answer copies runs of
  its input, which prompt lookup guesses;
- **chat**: open questions with no source text, where guesses are mostly rejected and
  the policy (pausing requests of low acceptance) must keep the speed of decoding
  without speculation.

Per workload: output tokens/s = completion tokens / wall time from the first request
sent to the last answer; the acceptance rate (accepted / proposed guesses) and the mean
accepted guesses per verification (a request's verify step with at least one guess),
from the ``shardserve_spec_decode_*_total`` counters' deltas at ``/metrics``; and how
many answers are identical with and without speculation, token for token (each answer's
tokens as ``logprobs.content`` names them, and its text). Each server first answers one
warm-up request; the batch-8 runs follow the batch-1 runs of the same prompts, so their
prompts come from the prefix cache (with speculation off and on alike).

``--sweep`` then starts one server per configuration (``;``-separated launch flags
added to ``--spec-args``) and runs the grounded prompts at batch 1 on each: the
lookahead and n-gram lengths the defaults are chosen from.

Usage: ``python -m benchmarks.serving.speculative_cpu [--max-tokens 128]
[--sweep "--num-speculative-tokens 2;--ngram-min 1"] [--out
benchmarks/results/speculative-cpu.md]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness import free_port, header, start_server, stop_server, wait_healthy

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


# ---- one workload's run --------------------------------------------------------------------

_COUNTER = re.compile(
    r"^shardserve_spec_decode_(proposed_tokens|accepted_tokens|verifications)"
    r"_total (\S+)$"
)


def spec_counters(text: str) -> dict[str, float]:
    """The speculation counters of a Prometheus exposition: ``proposed_tokens``,
    ``accepted_tokens``, ``verifications`` (absent ones are 0)."""
    found = {"proposed_tokens": 0.0, "accepted_tokens": 0.0, "verifications": 0.0}
    found.update({m[1]: float(m[2]) for line in text.splitlines() if (m := _COUNTER.match(line))})
    return found


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
        proposed: guesses proposed (counter delta).
        accepted: guesses accepted.
        verifications: requests' verify steps with at least one guess.
    """

    seconds: float
    answers: list[Answer] = field(default_factory=list)
    proposed: float = 0.0
    accepted: float = 0.0
    verifications: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(a.tokens) for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def acceptance(self) -> float:
        """Accepted / proposed guesses; NaN when none was proposed."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def accepted_per_verification(self) -> float:
        """Mean accepted guesses per verification; NaN when none ran."""
        return self.accepted / self.verifications if self.verifications else float("nan")


async def _ask(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Answer:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": model,
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


async def run_workload(base: str, prompts: Sequence[str], batch: int, max_tokens: int) -> Run:
    """Send ``prompts`` to the server at ``base`` with at most ``batch`` in flight (a new
    one as soon as one is answered); the speculation counters' deltas over the run."""
    gate = asyncio.Semaphore(batch)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900.0)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = spec_counters((await client.get("/metrics")).text)

        async def one(prompt: str) -> Answer:
            async with gate:
                return await _ask(client, model, prompt, max_tokens)

        start = time.perf_counter()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        after = spec_counters((await client.get("/metrics")).text)
    delta = {k: after[k] - before[k] for k in after}
    return Run(
        seconds,
        list(answers),
        delta["proposed_tokens"],
        delta["accepted_tokens"],
        delta["verifications"],
    )


def serve_workloads(
    args: argparse.Namespace, flags: list[str], workloads: Sequence[str], env: Mapping[str, str]
) -> dict[str, Run]:
    """Start a server with launch ``flags``, answer one warm-up request, run each of
    ``workloads`` (``set-batch``) in order and stop it."""
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(port, args.model, ["--device", args.device, *flags], log_path, env)
    runs: dict[str, Run] = {}
    try:
        wait_healthy(proc, base, log_path, args.startup_timeout)
        asyncio.run(run_workload(base, ["Say hello."], 1, 16))
        for name in workloads:
            prompt_set, batch = name.rsplit("-", 1)
            runs[name] = asyncio.run(
                run_workload(base, PROMPT_SETS[prompt_set], int(batch), args.max_tokens)
            )
            print(
                f"  {' '.join(flags) or '(off)'} {name}: {runs[name].tokens} tokens in "
                f"{runs[name].seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop_server(proc)
    return runs


# ---- the tables ----------------------------------------------------------------------------


def identical(off: Run, on: Run) -> int:
    """Answers equal token for token (and in text) with and without speculation."""
    return sum(
        a.tokens == b.tokens and a.text == b.text
        for a, b in zip(off.answers, on.answers, strict=True)
    )


def _spec_cells(off: Run, on: Run) -> str:
    return (
        f"{on.tokens_per_s / off.tokens_per_s:.2f}× | {on.acceptance:.2f} "
        f"| {on.accepted_per_verification:.2f} | {identical(off, on)}/{len(off.answers)}"
    )


def workload_table(off: Mapping[str, Run], on: Mapping[str, Run]) -> list[str]:
    """Markdown rows: per workload, speculation off against on."""
    lines = [
        "| prompts | batch | output tokens | off tok/s | on tok/s | on/off | acceptance "
        "| accepted / verification | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in off:
        prompt_set, batch = name.rsplit("-", 1)
        a, b = off[name], on[name]
        lines.append(
            f"| {prompt_set} | {batch} | {a.tokens} | {a.tokens_per_s:.1f} "
            f"| {b.tokens_per_s:.1f} | {_spec_cells(a, b)} |"
        )
    return lines


def sweep_table(off: Run, configs: Mapping[str, Run]) -> list[str]:
    """Markdown rows: the grounded batch-1 workload under each speculation config."""
    lines = [
        "| speculation flags | tok/s | on/off | acceptance | accepted / verification | identical |",
        "|---|---:|---:|---:|---:|---:|",
        f"| (off) | {off.tokens_per_s:.1f} | 1.00× | - | - | - |",
    ]
    for flags, run in configs.items():
        lines.append(f"| `{flags}` | {run.tokens_per_s:.1f} | {_spec_cells(off, run)} |")
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
        default="--num-speculative-tokens 2;--num-speculative-tokens 5;"
        "--ngram-min 1;--ngram-min 1 --num-speculative-tokens 5",
        help="';'-separated flags added to --spec-args, each run on grounded "
        "prompts at batch 1 ('' for none)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of the servers (default: torch's own choice)",
    )
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    p.add_argument(
        "--answers",
        type=Path,
        default=None,
        help="write every answer's text, off and on, here (JSON)",
    )
    return p.parse_args(argv)


def report(
    args: argparse.Namespace,
    off: Mapping[str, Run],
    on: Mapping[str, Run],
    sweep: Mapping[str, Run],
) -> str:
    """The markdown report: heading, setting, the workload table and the sweep's."""
    launch = f"shardserve launch --executor local {args.server_args}".strip()
    lines = [
        header("Speculative decoding, n-gram guesses", args.device, "torch"),
        "",
        f"`{Path(args.model).name}`, `{launch}` against `{args.spec_args}`; "
        f"greedy `/v1/chat/completions`, max_tokens {args.max_tokens}, EOS ends an "
        f"answer; {len(GROUNDED)} grounded and {len(CHAT)} chat prompts per workload.",
        "",
        *workload_table(off, on),
    ]
    if sweep:
        lines += [
            "",
            f"Grounded prompts at batch 1 by speculation flags (added to `{args.spec_args}`):",
            "",
            *sweep_table(off["grounded-1"], sweep),
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = {"RAY_AUTH_MODE": "disabled"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    common = shlex.split(args.server_args)
    spec = shlex.split(args.spec_args)
    off = serve_workloads(args, common, args.workloads, env)
    on = serve_workloads(args, [*common, *spec], args.workloads, env)
    sweep: dict[str, Run] = {}
    configs = [c.strip() for c in args.sweep.split(";") if c.strip()]
    if configs and "grounded-1" in off:
        for config in configs:
            sweep[config] = serve_workloads(
                args, [*common, *spec, *shlex.split(config)], ["grounded-1"], env
            )["grounded-1"]
    text = report(args, off, on, sweep)
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
