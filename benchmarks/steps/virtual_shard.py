"""A shard process with a virtual device: the real gRPC server and
:class:`~shard.servicer.ShardServicer`, over a runner that computes nothing and takes
a fixed time per step, so that the router's period over gRPC can be measured against
a known device step without a GPU (``benchmarks/steps/router_step.py --shards grpc``).

The runner keeps the shard's protocol (requests held by id from their first Prefill
until finished, chunks, every decoding row in each Decode, step order, launch while the
previous step computes) and emits each request's ids from a fixed cycle. Its device runs
steps one after another, each from the later of its launch and the previous step's end;
``finish_step`` sleeps until the step's end.

    python -m benchmarks.steps.virtual_shard --port 50071 --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from shard import step_trace
from shard.config import ShardConfig
from shard.pb import shard_pb2_grpc
from shard.pending_step import PendingStep
from shard.records import DecodeStep, Generation, PrefillStep, ShardInfo, StepOutput
from shard.servicer import ShardServicer

IDS = tuple(range(1000, 1050))
NO_CHANGE = DecodeStep()


@dataclass
class _VirtualPending(PendingStep):
    ends_at: float = 0.0  # perf_counter() when the virtual device finishes the step
    tokens: tuple[Generation, ...] = ()
    idle_s: float = 0.0  # how long the virtual device sat idle before the step
    seconds: float = 0.0  # the step's device time


class VirtualRunner:
    """The :class:`~shard.model_runner.ModelRunner` surface the servicer uses, over a
    virtual device: a Decode takes ``step_s``, a Prefill ``step_s`` plus
    ``prefill_token_s`` per prompt token computed; ``num_blocks`` KV blocks of
    ``block_size``. Requests are held by id (the step contract): new ones, chunks of
    held ones, finished ones leaving before the step; every decoding row decodes."""

    def __init__(self, step_s: float, prefill_token_s: float = 0.0, num_blocks: int = 1 << 20,
                 block_size: int = 16, step_trace_dir: str = "") -> None:
        self.config = ShardConfig(model_path="virtual", device="cpu",
                                  step_trace_dir=step_trace_dir)
        self.trace = step_trace.from_config(self.config)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_s, self.prefill_token_s = step_s, prefill_token_s
        self._held: dict[int, list[int]] = {}  # request id -> [tokens cached, prompt length]
        self._rows: list[int] = []  # decoding rows, in row order
        self._generated: dict[int, int] = {}
        self._busy_until = 0.0
        self._clock = threading.Lock()

    def _occupy(self, seconds: float) -> tuple[float, float]:
        """Queue ``seconds`` of device work; returns when it ends (perf_counter) and how
        long the device sat idle before it (seconds; 0 for the first step)."""
        with self._clock:
            now = time.perf_counter()
            idle = max(0.0, now - self._busy_until) if self._busy_until else 0.0
            self._busy_until = max(now, self._busy_until) + seconds
            return self._busy_until, idle

    def _next(self, request_id: int) -> Generation:
        count = self._generated.get(request_id, 0)
        self._generated[request_id] = count + 1
        return Generation(request_id, IDS[count % len(IDS)], -0.5)

    def _finish(self, request_ids: Sequence[int]) -> None:
        """Drop the finished requests (ValueError for an id not held, as the runner)."""
        unknown = [rid for rid in request_ids if rid not in self._held]
        if unknown:
            raise ValueError(f"finished_request_ids {sorted(unknown)[:5]} are not held")
        leaving = set(request_ids)
        for rid in leaving:
            del self._held[rid]
            self._generated.pop(rid, None)
        self._rows = [rid for rid in self._rows if rid not in leaving]

    def info(self) -> ShardInfo:
        return ShardInfo(model_id="virtual", dtype="bfloat16", device="cpu", rank=0,
                         world_size=1, block_size=self.block_size, num_blocks=self.num_blocks,
                         attention_backend="virtual", attention_backend_reason="benchmark",
                         max_position_embeddings=1 << 20, vocab_size=49152)

    def warmup(self, max_batch_prefill_tokens: int, max_total_tokens: int,
               max_batch_size: int, hold_total: bool = True) -> int:
        self.reset()
        return self.num_blocks

    def prefill(self, step: PrefillStep, trace_step: int = -1) -> StepOutput:
        launched = self.launch_prefill(step, trace_step)
        return launched if isinstance(launched, StepOutput) else self.finish_step(launched)

    def launch_prefill(self, step: PrefillStep,
                       trace_step: int = -1) -> PendingStep | StepOutput:
        self._finish(step.finished_request_ids)
        rows = list(self._rows) if step.decode else []  # a mixed step's rows ride along
        tokens = 0
        completed = []
        for c in step.cached_requests:
            held = self._held[c.request_id]
            end = held[1] if c.num_tokens == 0 else held[0] + c.num_tokens
            tokens += end - held[0]
            held[0] = end
            if end == held[1]:
                completed.append(c.request_id)
        for r in step.new_requests:
            if r.request_id in self._held:
                raise ValueError(f"request {r.request_id} is already held by this shard")
            self._held[r.request_id] = [r.end, len(r.input_ids)]
            tokens += r.end - r.cache_len
            if not r.partial:
                completed.append(r.request_id)
        seconds = self.step_s + tokens * self.prefill_token_s
        if not completed and not rows:
            _, idle_s = self._occupy(seconds)
            self.trace.mark("device_gap", trace_step, int(idle_s * 1e6))
            return StepOutput((), int(seconds * 1e9))
        self._rows.extend(completed)
        return self._pending(rows + completed, seconds, num_rows=len(rows))

    def launch_decode(self, step: DecodeStep = NO_CHANGE) -> PendingStep | StepOutput:
        self._finish(step.finished_request_ids)
        if not self._rows:
            return StepOutput((), 0)
        return self._pending(list(self._rows), self.step_s)

    def _pending(self, ids: list[int], seconds: float, num_rows: int = 0) -> _VirtualPending:
        """A step of ``seconds`` queued on the virtual device, its tokens chosen now
        (``num_rows``: a mixed step's rows, the first ids)."""
        pending = _VirtualPending([], None, None, num_rows=num_rows)  # type: ignore[arg-type]
        pending.ends_at, pending.idle_s = self._occupy(seconds)
        pending.seconds = seconds
        pending.tokens = tuple(self._next(rid) for rid in ids)
        return pending

    def finish_step(self, pending: PendingStep) -> StepOutput:
        assert isinstance(pending, _VirtualPending)
        time.sleep(max(0.0, pending.ends_at - time.perf_counter()))
        self.trace.mark("ready", pending.trace_step)
        self.trace.mark("device_gap", pending.trace_step, int(pending.idle_s * 1e6))
        return StepOutput(pending.tokens, int(pending.seconds * 1e9), num_rows=pending.num_rows)

    def reset(self) -> None:
        """Drop every request held (a restart step, or Warmup)."""
        self._held.clear()
        self._rows = []
        self._generated.clear()


async def serve(port: int, step_s: float, prefill_token_s: float,
                step_trace_dir: str = "") -> None:
    server = grpc.aio.server()
    runner = VirtualRunner(step_s, prefill_token_s, step_trace_dir=step_trace_dir)
    shard_pb2_grpc.add_ShardServiceServicer_to_server(
        ShardServicer(runner), server)  # type: ignore[arg-type]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()  # SIGTERM ends the process normally (its exit handlers run)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--step-trace-dir", default="", metavar="DIR",
                   help="append the step timestamps here (shard.step_trace); empty: none")
    args = p.parse_args()
    from loguru import logger

    logger.remove()
    asyncio.run(serve(args.port, args.step_ms / 1e3, args.prefill_us_per_token / 1e6,
                      args.step_trace_dir))


if __name__ == "__main__":
    main()
