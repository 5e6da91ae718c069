"""How long a burst of requests takes to reach an HTTP handler on this machine, without
the engine behind it: a diagnostic for the arrival phase of ``gpu_serving.py``'s
workloads (``request_timeline.py``), where the requests sent at once reached the router's
engine over ~0.2 s on the lent GPU machine and over 9-29 ms on a 2-core VM.

A minimal Starlette app under uvicorn (a subprocess) stamps ``time.time()`` when each
``POST /v1/completions`` handler has its JSON body and answers at once; the client is
the load client's (aiohttp, keep-alive connections opened first, every request sent
at once, ``prompt`` = ``--prompt-len`` token ids). Per server variant (uvicorn's HTTP
parser h11 or httptools, event loop asyncio or uvloop, TCP on loopback or a Unix socket;
variants whose packages are missing are skipped) it prints when the first and last
handler ran, counted from the first send, and when the last answer came back.

    python -m benchmarks.serving.arrival_probe --requests 256 --prompt-len 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.harness import free_port

_APP = '''
import time
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

stamps = []

async def complete(request):
    body = await request.json()
    stamps.append(time.time())
    return JSONResponse({"n": len(body["prompt"])})

async def health(request):
    return JSONResponse({})

async def arrivals(request):
    out = list(stamps)
    stamps.clear()
    return JSONResponse(out)

app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                        Route("/health", health), Route("/arrivals", arrivals)])
'''


async def _wait_ready(session: aiohttp.ClientSession, base: str) -> None:
    for _ in range(200):
        try:
            async with session.get(f"{base}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("the probe server did not start")


async def _round(connector_args: dict[str, object], base: str, requests: int,
                 prompt_len: int) -> tuple[float, float, float]:
    """(first handler, last handler, last answer) in seconds after the first send."""
    prompt = list(range(100, 100 + prompt_len))
    if "path" in connector_args:
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=str(connector_args["path"]),
                                                                 limit=requests + 2)
    else:
        connector = aiohttp.TCPConnector(limit=requests + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _wait_ready(session, base)

        async def warm() -> None:
            async with session.get(f"{base}/health") as response:
                await response.read()

        await asyncio.gather(*(warm() for _ in range(requests)))
        async with session.get(f"{base}/arrivals") as response:
            await response.read()

        async def one() -> None:
            async with session.post(f"{base}/v1/completions",
                                    json={"prompt": prompt, "max_tokens": 1}) as response:
                await response.read()

        start = time.time()
        await asyncio.gather(*(one() for _ in range(requests)))
        done = time.time()
        async with session.get(f"{base}/arrivals") as response:
            stamps = sorted(json.loads(await response.read()))
    return stamps[0] - start, stamps[-1] - start, done - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    have = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop")}
    print(f"# arrival probe: {args.requests} requests of {args.prompt_len} ids at once, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; median of {args.rounds} "
          f"rounds, ms after the first send")
    print("\n| http | loop | transport | first handler | last handler | last answer |")
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "probe_app.py").write_text(_APP)
        for http, loop, transport in itertools.product(("h11", "httptools"),
                                                       ("asyncio", "uvloop"), ("tcp", "uds")):
            if (http != "h11" and not have[http]) or (loop != "asyncio" and not have[loop]):
                continue
            cmd = [sys.executable, "-m", "uvicorn", "probe_app:app", "--http", http,
                   "--loop", loop, "--log-level", "warning", "--no-access-log"]
            if transport == "uds":
                path = Path(tmp) / "probe.sock"
                cmd += ["--uds", str(path)]
                connector: dict[str, object] = {"path": path}
                base = "http://localhost"
            else:
                port = free_port()
                cmd += ["--port", str(port)]
                connector, base = {}, f"http://127.0.0.1:{port}"
            server = subprocess.Popen(cmd, cwd=tmp)
            try:
                results = [asyncio.run(_round(connector, base, args.requests, args.prompt_len))
                           for _ in range(args.rounds)]
            finally:
                server.terminate()
                server.wait()
            first, last, answered = (statistics.median(r[i] for r in results) * 1e3
                                     for i in range(3))
            print(f"| {http} | {loop} | {transport} | {first:.1f} | {last:.1f} | "
                  f"{answered:.1f} |", flush=True)


if __name__ == "__main__":
    main()
