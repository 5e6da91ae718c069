"""``shardserve launch``: start the shard group, warm it up, then serve HTTP and gRPC.

Order: resolve the model (converting the default one once) → bind the HTTP and gRPC
ports (a port in use ends the launch at once) → start one shard per rank
(Ray actors, or local processes) → wait for every gRPC server → ``Info`` and ``Warmup``
(KV blocks = minimum over ranks) → build the engine → serve HTTP (uvicorn) and the
public gRPC API (``--grpc-port``) until SIGINT/SIGTERM → stop the engine and the shards.
Each wait is announced in the log (placement, model load, warm-up phases), and while
serving a busy server logs a status line every ``--status-interval`` seconds.

While serving, :class:`Supervisor` polls the executor; when a rank dies it fails the
in-flight requests, restarts the whole group (``--max-restarts`` times), warms it up
again and hands the engine the new client, an empty block manager sized by the new
Warmup and the token budgets derived from it (which the validator reads too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import os
import signal
import sys
import time
from collections.abc import Callable

from loguru import logger

from router.api.process import ApiProcesses
from router.api.server import (
    ApiServers,
    ModelFacts,
    ServerPorts,
    log_serving,
    make_state,
    package_version,
)
from router.api.state import ServerState
from router.config import SchedulerConfig, ServerConfig, derive_budgets
from router.engine.loop import Engine
from router.executors import LocalExecutor, RayExecutor, ShardExecutor, StartupError
from router.health import NOT_ANSWERING_AFTER_S
from router.log import STILL_WAITING_S, announce_wait
from router.shard_client import ShardClient
from router.status_log import StatusLogger
from router.step_deadline import StepDeadline
from router.step_trace import Trace, step_trace
from router.tokenizer import Tokenizer
from shard.config import ShardConfig, quantization_details
from shard.pb.shard_pb2 import InfoResponse

SHARD_START_TIMEOUT_S = 1800.0
LIVENESS_POLL_S = 0.5
SHUTDOWN_MESSAGE = "the server shut down before the request finished (--graceful-timeout)"


def make_executor(config: ServerConfig) -> ShardExecutor:
    """The executor ``--executor`` names."""
    if config.executor == "local":
        return LocalExecutor(config.shard, master_port=config.master_port)
    return RayExecutor(config.shard, ray_address=config.ray_address, placement=config.placement,
                       placement_timeout_s=config.placement_timeout_s)


@dataclasses.dataclass(frozen=True)
class WarmupBudgets:
    """What every Warmup of the group is asked for (again after a restart), in tokens."""

    max_batch_prefill_tokens: int
    max_total_tokens: int
    max_batch_size: int  # rows of the largest decode CUDA graph (see graph_rows)
    # no --max-total-tokens: the default is lowered to the KV cache's capacity afterwards
    max_total_tokens_derived: bool = False


async def start_group(
    executor: ShardExecutor, timeout_s: float, step_timeout_s: float = 0.0,
    trace: Trace | None = None,
) -> ShardClient:
    """Start the shard group and wait until every rank answers Health.

    ``step_timeout_s`` is ``--step-timeout``: the deadline of every Prefill and Decode,
    seconds, or 0 for the adaptive one (see :mod:`router.step_deadline`); ``trace``: the
    client's step trace (:mod:`router.step_trace`; none by default).

    Raises:
        StartupError: a rank died during start-up (checked every second), so a failed
            shard is reported at once instead of after ``timeout_s``.
        ShardError: a rank did not answer within ``timeout_s`` seconds.
    """
    addresses = await executor.start()
    client = ShardClient(addresses, StepDeadline(fixed_s=step_timeout_s or None), trace)
    ready = asyncio.ensure_future(client.wait_ready(timeout_s))
    started = time.monotonic()
    next_note = started + STILL_WAITING_S
    try:
        while not ready.done():
            await asyncio.wait({ready}, timeout=1.0)
            rank = None if ready.done() else await executor.dead_rank()
            if rank is not None:
                raise StartupError(f"shard rank {rank} exited during start-up (see its log)")
            if not ready.done() and time.monotonic() >= next_note:
                logger.info("still waiting for the shards to load the model ({:.0f} s)",
                            time.monotonic() - started)
                next_note += STILL_WAITING_S
        ready.result()
        executor.mark_ready()
    except BaseException:
        ready.cancel()
        await client.close()
        raise
    return client


def warmed_up_budgets(
    config: ServerConfig, info: InfoResponse, num_blocks: int
) -> SchedulerConfig:
    """The scheduler's budgets once the group has warmed up: the flags, with the unset
    token budgets derived from the model (``info``) and the ``num_blocks`` KV blocks
    Warmup sized (see :func:`~router.config.derive_budgets`). Built again after every
    restart, since a restarted group may hold fewer blocks.

    Raises:
        ValueError: a given budget exceeds the model's context length.
    """
    budgets = derive_budgets(
        config.budget_flags, info.max_position_embeddings, num_blocks * info.block_size,
        chunked_prefill=config.scheduler.chunked_prefill,
        device_type=info.device.split(":")[0],
    )
    return dataclasses.replace(config.scheduler, **budgets)


def graph_rows(max_batch_size: int, k: int, speculative_batch: int) -> int:
    """Rows of the largest decode step, for the decode CUDA graphs: the running batch,
    or with ``k`` guesses per request the verify step's one row per query token of the
    largest batch that speculates (``speculative_batch`` requests)."""
    if not k:
        return max_batch_size
    return max(max_batch_size, min(max_batch_size, speculative_batch) * (k + 1))


def speculation_details(shard: ShardConfig, scheduler: SchedulerConfig) -> str:
    """How decode steps speculate, in words for ``/info`` and the log; empty when off."""
    k = scheduler.num_speculative_tokens
    if not k:
        return ""
    source = (f"draft model {shard.speculative_model}" if shard.speculative_method == "draft"
              else f"n-gram prompt lookup ({shard.ngram_min}-{shard.ngram_max} tokens)")
    return (f"{source}, up to {k} guesses per request and step, off above "
            f"{scheduler.speculative_disable_batch_size} running requests")


async def build_engine(
    config: ServerConfig, client: ShardClient
) -> tuple[Engine, ModelFacts, WarmupBudgets]:
    """Ask the shards for Info, run Warmup and build the engine (not started)."""
    infos = await client.info()
    first = infos[0]
    device_type = first.device.split(":")[0]
    before = derive_budgets(config.budget_flags, first.max_position_embeddings,
                            chunked_prefill=config.scheduler.chunked_prefill,
                            device_type=device_type)
    warmup = WarmupBudgets(
        before["max_batch_prefill_tokens"], before["max_total_tokens"],
        graph_rows(before["max_batch_size"], config.scheduler.num_speculative_tokens,
                   before["speculative_disable_batch_size"]),
        max_total_tokens_derived=config.budget_flags.get("max_total_tokens") is None,
    )
    logger.info("warming up {} shard(s) on {}: sizing the KV cache and a worst-case prefill of "
                "{} tokens (each phase is logged)", len(infos), first.device,
                before["max_batch_prefill_tokens"])
    started = time.monotonic()
    # Local shards share this terminal, where rank 0 draws a bar: no lines across it.
    quiet = config.executor == "local" and sys.stderr.isatty()
    num_blocks = await announce_wait(
        client.warmup(
            warmup.max_batch_prefill_tokens, warmup.max_total_tokens, warmup.max_batch_size,
            warmup.max_total_tokens_derived,
        ),
        "the warm-up", quiet=quiet)
    logger.info("warm-up done in {:.1f} s", time.monotonic() - started)
    scheduler = warmed_up_budgets(config, first, num_blocks)
    logger.info("budgets: max_total_tokens={} max_input_tokens={} max_batch_prefill_tokens={} "
                "max_batch_size={} waiting_served_ratio={} max_concurrent_requests={}",
                scheduler.max_total_tokens, scheduler.max_input_tokens,
                scheduler.max_batch_prefill_tokens, scheduler.max_batch_size,
                scheduler.waiting_served_ratio, scheduler.max_concurrent_requests)
    logger.info(
        "shards ready: {} rank(s), {} on {}, attention {}, {} KV blocks of {} tokens",
        len(infos), first.dtype, first.device, first.attention_backend, num_blocks,
        first.block_size,
    )
    tokenizer = Tokenizer.from_folder(config.shard.model_path)
    engine = Engine(client, tokenizer, scheduler, num_blocks, first.block_size, client.trace)
    facts = ModelFacts(
        model_id=config.served_model_names[0] if config.served_model_names else first.model_id,
        dtype=first.dtype,
        device_type=device_type,
        num_shard=first.world_size,
        attention_backend=first.attention_backend,
        version=package_version(),
        quantization=config.shard.quantization,
        kv_cache_dtype="float8_e4m3fn" if config.shard.kv_cache_dtype == "fp8" else first.dtype,
        quantization_details=quantization_details(config.shard),
        speculative_decoding=speculation_details(config.shard, scheduler),
    )
    if facts.quantization_details:
        logger.info("quantized: {}", facts.quantization_details)
    if facts.speculative_decoding:
        logger.info("speculative decoding: {}", facts.speculative_decoding)
    return engine, facts, warmup


async def build_state(
    config: ServerConfig, client: ShardClient
) -> tuple[ServerState, WarmupBudgets]:
    """:func:`build_engine`, and the state the APIs serve in this process."""
    engine, facts, warmup = await build_engine(config, client)
    return make_state(engine, engine.scheduler, engine.tokenizer, facts, config), warmup


def api_server_count(config: ServerConfig, facts: ModelFacts) -> int:
    """API processes to start beside the engine: ``--api-server-count``, or by default
    one when the shards run on a GPU (whose steps are short enough for the HTTP layer's
    work to make it wait) and none on CPU."""
    if config.api_server_count is not None:
        return config.api_server_count
    return 1 if facts.device_type == "cuda" else 0


async def serve(config: ServerConfig) -> int:
    """Run the whole server until interrupted; return the exit code (1 when the shard
    group died with no restart left, or an API process failed, else 0).

    Raises:
        StartupError: a port is in use (before any shard starts), or the group or an
            API process could not be started.
    """
    ports = ServerPorts(config)
    try:
        return await _serve(config, ports)
    finally:
        ports.close()


async def _serve(config: ServerConfig, ports: ServerPorts) -> int:
    """:func:`serve` on the bound ``ports``."""
    executor = make_executor(config)
    client: ShardClient | None = None
    supervisor: Supervisor | None = None
    frontend: ApiServers | ApiProcesses | None = None
    try:
        logger.info("starting {} shard(s) with the {} executor", config.shard.world_size,
                    config.executor)
        client = await start_group(executor, SHARD_START_TIMEOUT_S, config.step_timeout_s,
                                   step_trace(config.shard.step_trace_dir))
        engine, facts, warmup = await build_engine(config, client)
        http_socket = ports.listen()
        engine.start()
        count = api_server_count(config, facts)
        if count:
            logger.info("starting {} API process(es) beside the engine", count)
            frontend = ApiProcesses(engine, config, facts, count, http_socket)
        else:
            state = make_state(engine, engine.scheduler, engine.tokenizer, facts, config)
            frontend = ApiServers(state, config, http_socket=http_socket)
        try:
            await frontend.start()
            # NOTE: start-up objects (tokenizer, modules) never become garbage; taken out
            # of the collector's reach, each full collection (which stops the event loop)
            # stays short while large requests allocate.
            gc.collect()
            gc.freeze()
            log_serving(facts.model_id, config, frontend.grpc_port, frontend.http_port)
            deadline = ShutdownDeadline(engine, config.graceful_timeout_s)
            if isinstance(frontend, ApiProcesses):
                frontend.on_failure = functools.partial(_stop_serving, frontend, engine,
                                                        deadline)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, _request_exit, frontend, engine, deadline,
                                        config.graceful_timeout_s, signum)
            supervisor = Supervisor(executor, engine, config, warmup,
                                    on_give_up=frontend.request_exit)
            watches = [asyncio.ensure_future(supervisor.run())]
            if config.status_interval_s:
                status = StatusLogger(engine, config.status_interval_s)
                watches.append(asyncio.ensure_future(status.run()))
            try:
                await frontend.serve()
            finally:
                for watch in watches:
                    watch.cancel()
                await asyncio.gather(*watches, return_exceptions=True)
                await deadline.cancel()
        finally:
            await engine.stop()
            await engine.shards.client.close()  # the group's client now (after restarts)
            client = None
    finally:
        if client is not None:
            await client.close()
        await executor.stop()
        logger.info("stopped")
    gave_up = supervisor is not None and supervisor.gave_up
    code = 1 if gave_up or (frontend is not None and frontend.failed) else 0
    if executor.exit_at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class Supervisor:
    """Restart the shard group when a rank dies or hangs.

    A rank is dead when the executor says so (process or actor gone, or no answer to a
    liveness ping), and hung when one of its steps ran past the step deadline. What it
    sees goes to the engine's :class:`~router.health.ShardHealth`, which health probes
    read: not answering (a ping waiting longer than ``NOT_ANSWERING_AFTER_S``),
    restarting, down, live again.

    Args:
        executor: the group's executor (liveness via ``dead_rank``).
        engine: the running engine; it gets the new client, an empty block manager and
            the budgets derived from the new Warmup (:func:`warmed_up_budgets`).
        config: the server's configuration: ``max_restarts`` restarts are allowed over
            the server's life (after that ``on_give_up`` is called, the server exits
            and requests keep failing); restarted groups get ``step_timeout_s``.
        warmup: the budgets Warmup is asked for after each restart.
        on_give_up: called once when no restart is left.
    """

    def __init__(self, executor: ShardExecutor, engine: Engine, config: ServerConfig,
                 warmup: WarmupBudgets, on_give_up: Callable[[], None]) -> None:
        self.executor = executor
        self.engine = engine
        self.config = config
        self.warmup = warmup
        self.max_restarts = config.max_restarts
        self.on_give_up = on_give_up
        self.step_timeout_s = config.step_timeout_s
        self.restarts = 0
        self.gave_up = False
        self.health = engine.shard_health

    async def _failed_rank(self) -> tuple[int, str] | None:
        """(rank, what happened) for a rank that is dead or hung, else None."""
        hung = self.engine.shards.client.hung_rank
        if hung is not None:
            return hung, "is hung (a step ran past the step deadline)"
        rank = await self.executor.dead_rank()
        return None if rank is None else (rank, "died or stopped answering")

    async def _check(self) -> tuple[int, str] | None:
        """:meth:`_failed_rank`, recording in :attr:`health` that the group is not
        answering once the check has waited ``NOT_ANSWERING_AFTER_S`` (the ping's own
        timeout is longer), and that it is live when every rank answered."""
        started = time.monotonic()
        check = asyncio.ensure_future(self._failed_rank())
        try:
            done, _ = await asyncio.wait({check}, timeout=NOT_ANSWERING_AFTER_S)
            if not done:
                # one rank: it is the silent one; several are pinged together
                rank = 0 if self.config.shard.world_size == 1 else None
                self.health.not_answering(rank, started)
            failed = await check
        finally:
            check.cancel()
        if failed is None:
            self.health.live()
        return failed

    async def run(self) -> None:
        """Poll liveness every 0.5 s; restart on a dead or hung rank, until cancelled or
        out of restarts."""
        while True:
            await asyncio.sleep(LIVENESS_POLL_S)
            failed = await self._check()
            if failed is None:
                continue
            message = "shard rank {} {}".format(*failed)
            logger.error("{}", message)
            self.health.restarting(message)
            await self.engine.stop()
            self.engine.fail_all(message)
            if self.engine.draining:  # shutting down: no group is started again
                self.health.down(f"{message}; the server is shutting down")
                return
            if not await self._restart():
                logger.error("no shard-group restart left (--max-restarts {}); exiting",
                             self.max_restarts)
                self.health.down(f"{message}; no restart left")
                # New requests are refused (503) while the server exits.
                self.engine.drain()
                self.engine.fail_all("the shard group is down", include_waiting=True)
                self.gave_up = True
                self.on_give_up()
                return

    async def _restart(self) -> bool:
        """Stop what is left of the group and start it again; True once it serves."""
        while self.restarts < self.max_restarts:
            self.restarts += 1
            logger.info("restarting the shard group ({}/{})", self.restarts, self.max_restarts)
            await self.executor.stop_group(grace_s=3.0)
            await self.engine.shards.client.close()
            client: ShardClient | None = None
            try:
                client = await start_group(self.executor, SHARD_START_TIMEOUT_S,
                                           self.step_timeout_s, self.engine.trace)
                infos = await client.info()
                num_blocks = await client.warmup(
                    self.warmup.max_batch_prefill_tokens, self.warmup.max_total_tokens,
                    self.warmup.max_batch_size, self.warmup.max_total_tokens_derived,
                )
                budgets = warmed_up_budgets(self.config, infos[0], num_blocks)
            except Exception as error:
                logger.error("restarting the shard group failed: {}", error)
                if client is not None:
                    await client.close()
                continue
            self.engine.replace_shards(client, budgets, num_blocks, infos[0].block_size)
            self.engine.start()
            self.health.live()
            logger.info("shard group restarted: {} rank(s), {} KV blocks, max_total_tokens={}",
                        len(infos), num_blocks, budgets.max_total_tokens)
            return True
        return False


class ShutdownDeadline:
    """Fails the requests still unfinished when the graceful timeout ends.

    The HTTP and gRPC servers wait ``ANSWER_MARGIN_S`` seconds longer
    (:mod:`router.api.server`) before they cancel the handlers still running (a
    non-streaming client would get a plain-text 500, a stream would be cut without a
    word, and each would log a traceback), so every request failed here ends the way a
    failed generation does: a JSON error, or an error event ending the stream (gRPC:
    UNAVAILABLE, which tells the client to retry), each naming the shutdown.

    Args:
        engine: The engine whose requests are failed.
        grace_s: ``--graceful-timeout``, seconds.
    """

    def __init__(self, engine: Engine, grace_s: float) -> None:
        self.engine = engine
        self.grace_s = grace_s
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Arm the deadline (no-op once armed)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self._task = asyncio.ensure_future(self._fail_unfinished())

    async def _fail_unfinished(self) -> None:
        status = self.engine.status()
        if not status.running and not status.queue_size:
            return
        await self.engine.stop()  # the loop must not be inside a step that fail_all drops
        self.engine.fail_all(SHUTDOWN_MESSAGE, include_waiting=True)

    async def cancel(self) -> None:
        """Disarm the deadline; wait for a failing that has begun."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


def _request_exit(
    frontend: ApiServers | ApiProcesses, engine: Engine, deadline: ShutdownDeadline,
    grace_s: int, signum: int,
) -> None:
    """Stop admission: the engine refuses new requests, the API servers (or processes)
    stop accepting and wait up to ``--graceful-timeout`` for open requests (streams
    included) to finish, and requests still running when it ends are failed (see
    :class:`ShutdownDeadline`)."""
    logger.info("received {}, draining (graceful timeout {} s)", signal.Signals(signum).name,
                grace_s)
    _stop_serving(frontend, engine, deadline)


def _stop_serving(frontend: ApiServers | ApiProcesses, engine: Engine,
                  deadline: ShutdownDeadline) -> None:
    """Begin the drain: what a SIGTERM starts (see :func:`_request_exit`)."""
    engine.drain()
    frontend.request_exit()
    deadline.start()


def run(config: ServerConfig) -> int:
    """Blocking entry point of ``shardserve launch``; returns the exit code."""
    return asyncio.run(serve(config))
