"""The walk of one Prefill through the shard: how many times a reader who follows one
shard ``Prefill`` RPC, call by call, changes file. A tiny random Llama (2 layers,
hidden 64, vocab 256, fp32, CPU, ``torch`` attention, blocks of 4 tokens) is served by
the shard's own gRPC server in this process (``shard.server.start_server``), warmed up
(``Warmup(max_batch_prefill_tokens=64, max_total_tokens=128)``), and sent one
``Prefill`` (step 1) of one new greedy request of 20 tokens, built for whichever
protocol the tree's ``shard.pb`` has (``NewRequest``, or the older ``Batch`` of
``Request``). ``sys.setprofile`` (this thread) and ``threading.setprofile`` (the
worker threads of ``asyncio.to_thread``) see every Python call and return from the
first call of ``ShardServicer.Prefill`` to its last return; at each one the innermost
frame of that thread whose code lies in the ``shard`` package (``shard/**/*.py`` of the
tree imported; torch, grpc, asyncio and other library frames are skipped, a thread with
no shard frame contributes nothing) gives the file the walk is in. A thread's run of
events with a shard frame on its stack is kept whole, and the runs are put in the order
they began (the event loop's part before a worker's, the worker's before the loop
resumes), so that threads switching mid-run do not add moves. A *stay* is a maximal run
of consecutive events in one file (a change of file is a move); *files* counts distinct
files; *returns* counts stays in a file the walk had already left (stays − files).
``--verbose`` lists the stays as ``file:function`` (the first function, then the others
the stay entered, in order). Counts depend only on the code, not on timings.

    python -m benchmarks.steps.prefill_walk [--verbose]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import grpc
import torch
from loguru import logger
from transformers import LlamaConfig, LlamaForCausalLM

import shard
from shard.config import ShardConfig
from shard.pb import shard_pb2 as pb
from shard.pb import shard_pb2_grpc
from shard.server import start_server
from shard.servicer import ShardServicer

BLOCK_SIZE = 4
PROMPT_TOKENS = 20
# the tiny Llama of the shard unit tests
TINY_LLAMA: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@dataclass
class Stay:
    """A maximal run of the walk in one file: its path under the tree and the functions
    (qualified names) entered there, in order of first entry."""

    file: str
    functions: list[str] = field(default_factory=list)


class WalkRecorder:
    """Profile hook (``sys.setprofile`` signature) that records, per thread, the file of
    the innermost shard frame at each Python call and return, between the first call of
    ``handler`` and its last return."""

    def __init__(self, package_dir: Path, handler: CodeType) -> None:
        self.tree = str(package_dir.parent) + os.sep
        self.prefix = str(package_dir) + os.sep
        self.handler = handler
        self.active = False
        self._seq = itertools.count()
        self._files: dict[str, str | None] = {}  # co_filename -> path under the tree
        # thread id -> (start seq, events) of its open run; closed runs
        self._open: dict[int, tuple[int, list[tuple[str, str]]]] = {}
        self._closed: list[tuple[int, list[tuple[str, str]]]] = []
        self._last_handler_return = -1

    def _shard_file(self, code: CodeType) -> str | None:
        name = code.co_filename
        if name not in self._files:
            real = os.path.realpath(name)
            self._files[name] = real[len(self.tree):] if real.startswith(self.prefix) else None
        return self._files[name]

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if not self.active:
                if frame.f_code is not self.handler or self._last_handler_return >= 0:
                    return
                self.active = True
            innermost: FrameType | None = frame
        elif event == "return" and self.active:
            if frame.f_code is self.handler:  # a suspension or the last return
                self._last_handler_return = next(self._seq)
            innermost = frame.f_back
        else:  # c_call, c_return, c_exception: the Python frame does not change
            return
        while innermost is not None and self._shard_file(innermost.f_code) is None:
            innermost = innermost.f_back
        thread = threading.get_ident()
        if innermost is None:
            run = self._open.pop(thread, None)
            if run is not None:
                self._closed.append(run)
            return
        if thread not in self._open:
            self._open[thread] = (next(self._seq), [])
        file = self._shard_file(innermost.f_code)
        assert file is not None
        self._open[thread][1].append((file, innermost.f_code.co_qualname))

    def stays(self) -> list[Stay]:
        """The walk as stays, from the runs that began before the handler's last
        return."""
        runs = sorted(self._closed + list(self._open.values()))
        out: list[Stay] = []
        for start, events in runs:
            if start > self._last_handler_return:
                continue
            for file, function in events:
                if not out or out[-1].file != file:
                    out.append(Stay(file))
                if function not in out[-1].functions:
                    out[-1].functions.append(function)
        return out


def write_tiny_llama(folder: Path) -> None:
    """Seeded random fp32 Llama of :data:`TINY_LLAMA` saved as safetensors."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)  # torch's default fp32


def prefill_request() -> pb.PrefillRequest:
    """Step 1: one new greedy request of :data:`PROMPT_TOKENS` tokens, in the tree's
    protocol (``NewRequest``, or the older ``Batch`` of ``Request``)."""
    rng = random.Random(1234)
    fields: dict[str, Any] = dict(
        id=1, input_ids=[rng.randrange(3, 128) for _ in range(PROMPT_TOKENS)],
        block_ids=list(range(-(-PROMPT_TOKENS // BLOCK_SIZE))), sampling=pb.SamplingParameters())
    if hasattr(pb, "NewRequest"):
        return pb.PrefillRequest(new_requests=[pb.NewRequest(**fields)], step=1)
    old: Any = pb  # the protocol before NewRequest (commit 80134ce and earlier)
    return old.PrefillRequest(batch=old.Batch(id=1, requests=[old.Request(**fields)]), step=1)


async def walk(folder: Path) -> list[Stay]:
    """Serve the model in ``folder``, warm it up and record one Prefill's walk."""
    recorder = WalkRecorder(Path(shard.__file__).resolve().parent, ShardServicer.Prefill.__code__)
    # before any worker thread starts: asyncio.to_thread's threads inherit the hook
    threading.setprofile(recorder.hook)
    config = ShardConfig(model_path=str(folder), model_id="tiny-llama", device="cpu",
                         dtype="float32", block_size=BLOCK_SIZE, kv_cache_bytes=1024 * 1024)
    server, port = await start_server(config, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            await stub.Warmup(pb.WarmupRequest(max_batch_prefill_tokens=64,
                                               max_total_tokens=128))
            request = prefill_request()
            sys.setprofile(recorder.hook)
            try:
                response = await stub.Prefill(request)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
                recorder.active = False
            assert len(response.generations) == 1, "the Prefill sampled no first token"
    finally:
        await server.stop(grace=None)
    return recorder.stays()


def tree_label(package_dir: Path) -> str:
    """``<commit>`` of the tree holding ``shard/``, ``+edits`` when shard/ differs from it."""
    root = package_dir.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    return commit + ("+edits" if git("status", "--porcelain", "--", "shard") else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verbose", action="store_true", help="list the stays (file:function)")
    args = p.parse_args()
    logger.remove()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        write_tiny_llama(Path(folder))
        stays = asyncio.run(walk(Path(folder)))
    package_dir = Path(shard.__file__).resolve().parent
    files = len({s.file for s in stays})
    print(f"shard Prefill walk, {package_dir.parent}, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    if args.verbose:
        seen: set[str] = set()
        for i, s in enumerate(stays, 1):
            mark = "  (return)" if s.file in seen else ""
            seen.add(s.file)
            rest = f"  [+ {', '.join(s.functions[1:])}]" if len(s.functions) > 1 else ""
            print(f"{i:3d} {s.file}:{s.functions[0]}{mark}{rest}")
    print("| tree | stays | files | returns |")
    print("|---|---:|---:|---:|")
    print(f"| {tree_label(package_dir)} | {len(stays)} | {files} | {len(stays) - files} |")


if __name__ == "__main__":
    main()
