"""The HTTP path after a burst of whole answers: ``--requests`` non-streamed
``POST /v1/completions`` (token-id prompts, ``ignore_eos``) that all finish in the same
engine step, and the time from that step to the last answer received by the client.

The server is the real one (engine, scheduler, detokenizer, app, uvicorn; with
``--api-server-count 1`` the API process and its socket to the engine, as
``shardserve launch`` starts them) over the virtual device of
:mod:`benchmarks.steps.router_step` (``--device-ms`` per step). The device's first
Prefill waits until every request has been submitted, so that they decode together and
finish in one step. The client runs in a process of its own: ``httpx`` (one
``AsyncClient``, as the field report's client) or ``aiohttp`` (one session, as
:mod:`benchmarks.serving.completions_load`); its connections are opened before the run.

Per row: the last engine finish (the ``request N success`` log lines' times) to the
first and to the last answer received, ms; the span of the engine finishes, ms (the
finishing step's own work: the final decodes and the log lines). ``--floor`` adds rows
for a bare ASGI app on the same uvicorn server that answers the same bytes at once
(:func:`run_floor`): what the client and the HTTP server cost without us.

    python -m benchmarks.steps.answer_burst --floor --api-server-count 0 1 \
        --clients httpx aiohttp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from loguru import logger

from benchmarks.harness import free_port, header
from benchmarks.steps.router_step import DEFAULT_TOKENIZER, TEXT, TimedShards
from router.api.http_server import make_http_server
from router.api.process import ApiProcesses
from router.api.server import ApiServers, ModelFacts, make_state
from router.config import SchedulerConfig, ServerConfig
from router.detokenizer import generated_text
from router.engine.loop import Engine
from router.tokenizer import Tokenizer
from shard.config import ShardConfig
from shard.pb import shard_pb2 as pb


async def send_burst(kind: str, base: str, requests: int, prompt_len: int,
                     max_tokens: int) -> None:
    """The client (a process of its own): ``requests`` at once over connections opened
    before; prints the send time, each answer's arrival (``time.time()``) and each
    answer's ``completion_tokens``, as JSON."""
    url = base + "/v1/completions"
    bodies = [{"model": "m", "prompt": [1000 + (i + j) % 500 for j in range(prompt_len)],
               "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
              for i in range(requests)]
    done: list[float] = []

    def received(answer: dict[str, Any]) -> int:
        done.append(time.time())
        if "usage" not in answer:
            raise RuntimeError(str(answer)[:500])
        return int(answer["usage"]["completion_tokens"])

    if kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=requests + 2,
                              max_keepalive_connections=requests + 2)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            await asyncio.gather(*(client.get(base + "/health") for _ in range(requests)))

            async def one(body: dict[str, Any]) -> int:
                return received((await client.post(url, json=body)).json())

            sent = time.time()
            counts = await asyncio.gather(*(one(b) for b in bodies))
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=requests + 2)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def health() -> None:
                async with session.get(base + "/health") as response:
                    await response.read()

            async def post(body: dict[str, Any]) -> int:
                async with session.post(url, json=body) as response:
                    return received(await response.json())

            await asyncio.gather(*(health() for _ in range(requests)))
            sent = time.time()
            counts = await asyncio.gather(*(post(b) for b in bodies))
    print(json.dumps({"sent": sent, "done": done, "counts": counts}))


@dataclass
class GatedShards(TimedShards):
    """:class:`TimedShards` whose calls wait for :attr:`gate` (set once every request
    has been submitted; they are then applied in the order they came), so that the
    requests decode together."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        await self.gate.wait()
        return await super().prefill(request)

    async def decode(self, request: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        await self.gate.wait()  # sent behind the first Prefill: applied after it
        return await super().decode(request, num_rows)


@dataclass
class Row:
    api_servers: int
    client: str
    finish_span_ms: float  # first to last engine finish
    to_first_ms: float  # last engine finish -> first answer received
    to_last_ms: float  # last engine finish -> last answer received
    wall_s: float  # first send -> last answer


@contextlib.asynccontextmanager
async def serving(tokenizer_path: Path, requests: int, prompt_len: int, max_tokens: int,
                  device_s: float, api_servers: int) -> AsyncIterator[tuple[int, Engine,
                                                                           GatedShards]]:
    """The server on a free port: (port, engine, its virtual device)."""
    tokenizer = Tokenizer.from_folder(tokenizer_path)
    num_blocks = requests * ((prompt_len + max_tokens) // 16 + 4)
    scheduler = SchedulerConfig(
        max_input_tokens=prompt_len, max_total_tokens=prompt_len + max_tokens,
        max_batch_prefill_tokens=requests * prompt_len, max_batch_size=requests,
        max_concurrent_requests=requests * 2)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    shards = GatedShards(ids, num_blocks, step_s=device_s)
    engine = Engine(cast(Any, shards), tokenizer, scheduler, num_blocks, 16)
    config = ServerConfig(shard=ShardConfig(model_path=str(tokenizer_path)),
                          scheduler=scheduler, host="127.0.0.1", port=free_port(),
                          grpc_port=0, api_server_count=api_servers)
    facts = ModelFacts(model_id="m", dtype="bfloat16", device_type="cuda", num_shard=1,
                       attention_backend="triton", version="bench")
    engine.start()
    frontend: Any
    if api_servers:
        frontend = ApiProcesses(engine, config, facts, api_servers)
    else:
        frontend = ApiServers(make_state(engine, engine.scheduler, tokenizer, facts, config),
                              config)
    await frontend.start()
    task = asyncio.ensure_future(frontend.serve())
    gc.collect()
    gc.freeze()
    try:
        yield frontend.http_port, engine, shards
    finally:
        frontend.request_exit()
        await task
        await engine.stop()


async def run(tokenizer_path: Path, requests: int, prompt_len: int, max_tokens: int,
              device_s: float, api_servers: int, client: str) -> Row:
    finishes: list[float] = []
    sink = logger.add(lambda message: finishes.append(message.record["time"].timestamp()),
                      filter=lambda record: " success" in record["message"], level="INFO")
    try:
        async with serving(tokenizer_path, requests, prompt_len, max_tokens, device_s,
                           api_servers) as (port, engine, shards):
            submit = engine.submit
            submitted = 0

            def counting_submit(*args: Any, **kwargs: Any) -> Any:
                nonlocal submitted
                submitted += 1
                if submitted == requests:
                    shards.gate.set()
                return submit(*args, **kwargs)

            engine.submit = counting_submit  # type: ignore[method-assign]
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.steps.answer_burst", "client", client,
                f"http://127.0.0.1:{port}", str(requests), str(prompt_len), str(max_tokens),
                stdout=subprocess.PIPE)
            out, _ = await process.communicate()
    finally:
        logger.remove(sink)
    result = json.loads(out)
    assert result["counts"] == [max_tokens] * requests, result["counts"][:4]
    assert len(finishes) == requests, len(finishes)
    done, last = sorted(result["done"]), max(finishes)
    return Row(api_servers, client, (last - min(finishes)) * 1e3, (done[0] - last) * 1e3,
               (done[-1] - last) * 1e3, done[-1] - result["sent"])


async def run_floor(tokenizer_path: Path, requests: int, prompt_len: int, max_tokens: int,
                    client: str) -> Row:
    """The floor: a bare ASGI app on the same uvicorn server (:func:`make_http_server`)
    holds every ``POST`` until all have arrived, then answers each, 0.3 s later, with
    the bytes of an answer of ours of the same length (no engine, no framework)."""
    tokenizer = Tokenizer.from_folder(tokenizer_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = generated_text(tokenizer, [1000] * prompt_len,
                          [ids[i % len(ids)] for i in range(max_tokens)])
    answer = json.dumps({
        "id": "cmpl-" + "0" * 32, "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                  "total_tokens": prompt_len + max_tokens}}).encode()
    gate, released, held = asyncio.Event(), [0.0], [0]

    def release() -> None:
        released[0] = time.time()
        gate.set()

    async def app(scope: MutableMapping[str, Any],
                  receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
                  send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        body = b"{}"
        if scope["path"] == "/v1/completions":
            held[0] += 1
            if held[0] == requests:
                asyncio.get_running_loop().call_later(0.3, release)
            await gate.wait()
            body = answer
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    port = free_port()
    server = make_http_server(app, "127.0.0.1", port, 30.0, 1)
    serving_task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.steps.answer_burst", "client", client,
        f"http://127.0.0.1:{port}", str(requests), str(prompt_len), str(max_tokens),
        stdout=subprocess.PIPE)
    out, _ = await process.communicate()
    server.should_exit = True
    await serving_task
    result = json.loads(out)
    assert result["counts"] == [max_tokens] * requests, result["counts"][:4]
    done = sorted(result["done"])
    return Row(-1, client, 0.0, (done[0] - released[0]) * 1e3,
               (done[-1] - released[0]) * 1e3, done[-1] - result["sent"])


def main() -> None:
    if sys.argv[1:2] == ["client"]:
        kind, base, requests, prompt_len, max_tokens = sys.argv[2:7]
        asyncio.run(send_burst(kind, base, int(requests), int(prompt_len), int(max_tokens)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device-ms", type=float, default=10.0)
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--clients", nargs="+", choices=("httpx", "aiohttp"),
                        default=["httpx", "aiohttp"])
    parser.add_argument("--floor", action="store_true",
                        help="also the bare ASGI app's rows (see run_floor)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--log", default=os.devnull,
                        help="the server's log lines go here (as setup_logging's sink)")
    args = parser.parse_args()
    logger.remove()
    logger.add(args.log, level="INFO", backtrace=False, diagnose=False)
    print(header("answer burst", "cpu"))
    print(f"{args.requests} requests × {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each; virtual device {args.device_ms:g} ms per step")
    print("| API processes | client | engine finishes span, ms | last finish → first "
          "answer, ms | last finish → last answer, ms (runs) | wall, s |")
    print("|---:|---|---:|---:|---:|---:|")
    for api_servers in ([-1] if args.floor else []) + args.api_server_count:
        for client in args.clients:
            rows = [asyncio.run(
                run_floor(args.tokenizer, args.requests, args.prompt_len, args.max_tokens,
                          client) if api_servers < 0 else
                run(args.tokenizer, args.requests, args.prompt_len, args.max_tokens,
                    args.device_ms / 1e3, api_servers, client))
                    for _ in range(args.repeats)]
            best = min(rows, key=lambda r: r.to_last_ms)
            runs = ", ".join(f"{r.to_last_ms:.0f}" for r in rows)
            name = "bare ASGI app" if api_servers < 0 else str(api_servers)
            print(f"| {name} | {client} | {best.finish_span_ms:.1f} | "
                  f"{best.to_first_ms:.0f} | {best.to_last_ms:.0f} ({runs}) | "
                  f"{best.wall_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
