"""Send a workload of token-id prompts to the server's OpenAI ``POST /v1/completions``.

Every request: ``prompt`` = token ids, ``max_tokens`` = its output length,
``ignore_eos: true``, ``temperature: 0`` (greedy). At most ``concurrency`` requests are
in flight (0 = all at once; the server then runs up to its ``--max-batch-size`` and
queues the rest). Non-streaming runs give output tokens/s; streaming runs
(``stream: true``, one server-sent event per token) give TTFT and TPOT per request.
The server's Prometheus metrics are read before and after each run.

The client's connections (one per request in flight) are opened before the clock starts,
as a client with a keep-alive pool (``openai``'s, ``text-generation``'s) holds them:
the run times the server's work, not TCP set-up; ``warm=False`` opens them inside the
timed run instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from benchmarks.harness import metric_delta, scrape
from benchmarks.serving.workloads import Workload


class TokenCountError(RuntimeError):
    """The server's answer has another number of prompt or output tokens than sent."""


@dataclass
class LoadRun:
    """One run of a workload.

    Attributes:
        requests: Requests sent.
        output_tokens: Tokens generated, summed over requests.
        wall: Seconds from the first send to the last completion.
        ttft: Per streaming request, seconds from send to the first token event.
        tpot: Per streaming request of 2+ tokens, (last event - first event) /
            (tokens - 1), seconds.
        metrics: Deltas of the server's decode-step histograms and prefix-cache counter
            (see :func:`benchmarks.harness.scrape`).
        started_at, ended_at: ``time.time()`` at the first send and the last completion
            (to find the run's requests in the server's log).
    """

    requests: int
    output_tokens: int
    wall: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _check_usage(usage: dict[str, int], prompt: list[int], max_tokens: int) -> None:
    if usage["prompt_tokens"] != len(prompt) or usage["completion_tokens"] != max_tokens:
        raise TokenCountError(
            f"sent {len(prompt)} prompt ids for {max_tokens} tokens, the server counted "
            f"{usage['prompt_tokens']} prompt and {usage['completion_tokens']} output tokens")


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int],
                    max_tokens: int) -> int:
    async with session.post(url, json=_body(prompt, max_tokens, False)) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        answer = await response.json()
    _check_usage(answer["usage"], prompt, max_tokens)
    return int(answer["usage"]["completion_tokens"])


async def _stream(session: aiohttp.ClientSession, url: str, prompt: list[int],
                  max_tokens: int) -> tuple[int, float, float]:
    """Tokens, TTFT (s) and TPOT (s; NaN for one token) of one streaming request."""
    times: list[float] = []
    usage = None
    sent = time.perf_counter()
    async with session.post(url, json=_body(prompt, max_tokens, True)) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            if chunk.get("choices"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or len(times) != max_tokens:
        raise TokenCountError(f"stream of {max_tokens} tokens ended after {len(times)} "
                              f"token events (usage {usage})")
    _check_usage(usage, prompt, max_tokens)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return len(times), times[0] - sent, tpot


async def _metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as response:
        return scrape(await response.text())


async def _open_connections(session: aiohttp.ClientSession, base: str, count: int) -> None:
    """``count`` concurrent ``GET /health``: each opens a connection, which the session's
    pool keeps for the requests that follow."""
    async def one() -> None:
        async with session.get(f"{base}/health") as response:
            await response.read()

    await asyncio.gather(*(one() for _ in range(count)))


async def run_load(base: str, workload: Workload, concurrency: int, stream: bool,
                   warm: bool = True) -> LoadRun:
    """Send every request of ``workload`` to ``base`` (e.g. ``http://127.0.0.1:3000``),
    over connections opened before the clock starts unless ``warm`` is False.

    Raises:
        TokenCountError: an answer's token counts differ from the request's.
        RuntimeError: an HTTP error or an error event.
    """
    limit = concurrency if concurrency > 0 else len(workload.prompts)
    connector = aiohttp.TCPConnector(limit=limit + 2)
    timeout = aiohttp.ClientTimeout(total=None)
    url = f"{base}/v1/completions"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sem = asyncio.Semaphore(limit)

        async def one(prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
            async with sem:
                if stream:
                    return await _stream(session, url, prompt, max_tokens)
                return await _complete(session, url, prompt, max_tokens), 0.0, 0.0

        if warm:
            await _open_connections(session, base, limit)
        before = await _metrics(session, base)
        started_at, start = time.time(), time.perf_counter()
        results = await asyncio.gather(
            *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True)))
        wall = time.perf_counter() - start
        ended_at = time.time()
        after = await _metrics(session, base)
    run = LoadRun(len(results), sum(r[0] for r in results), wall,
                  metrics=metric_delta(before, after), started_at=started_at, ended_at=ended_at)
    if stream:
        run.ttft = [r[1] for r in results]
        run.tpot = [r[2] for r in results if r[2] == r[2]]  # NaN (one token) left out
    return run
