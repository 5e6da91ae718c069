"""``shardserve launch``: start the shard group, warm it up, then serve HTTP and gRPC.

Order: resolve the model (converting the default one once) → start one shard per rank
(Ray actors, or local processes) → wait for every gRPC server → ``Info`` and ``Warmup``
(KV blocks = minimum over ranks) → build the engine → serve HTTP (uvicorn) and the
public gRPC API (``--grpc-port``) until SIGINT/SIGTERM → stop the engine and the shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from loguru import logger

from router.api.app import ServerState, create_app
from router.config import ServerConfig, derive_budgets
from router.engine import Engine
from router.executors import LocalExecutor, RayExecutor, ShardExecutor
from router.grpc_api.server import start_grpc_server
from router.shard_client import ShardClient
from router.tokenizer import Tokenizer
from router.validation import Validator

SHARD_START_TIMEOUT_S = 1800.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`serve` installs handlers that
    ask it to exit, so shutdown runs our clean-up instead of re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def package_version() -> str:
    """Installed version of shardserve."""
    try:
        return version("shardserve")
    except PackageNotFoundError:
        return "0+unknown"


def make_executor(config: ServerConfig) -> ShardExecutor:
    """The executor ``--executor`` names."""
    if config.executor == "local":
        return LocalExecutor(config.shard)
    return RayExecutor(config.shard, ray_address=config.ray_address, placement=config.placement)


async def build_state(config: ServerConfig, client: ShardClient) -> ServerState:
    """Ask the shards for Info, run Warmup and build the engine and validator."""
    infos = await client.info()
    first = infos[0]
    max_position = first.max_position_embeddings
    chunked = config.scheduler.chunked_prefill
    before = derive_budgets(config.budget_flags, max_position, chunked_prefill=chunked)
    num_blocks = await client.warmup(before["max_batch_prefill_tokens"], before["max_total_tokens"])
    budgets = derive_budgets(config.budget_flags, max_position, num_blocks * first.block_size,
                             chunked_prefill=chunked)
    scheduler = dataclasses.replace(
        config.scheduler,
        max_total_tokens=budgets["max_total_tokens"],
        max_input_tokens=budgets["max_input_tokens"],
        max_batch_prefill_tokens=budgets["max_batch_prefill_tokens"],
    )
    logger.info("budgets: {}", budgets)
    logger.info(
        "shards ready: {} rank(s), {} on {}, attention {}, {} KV blocks of {} tokens",
        len(infos), first.dtype, first.device, first.attention_backend, num_blocks,
        first.block_size,
    )
    tokenizer = Tokenizer.from_folder(config.shard.model_path)
    engine = Engine(client, tokenizer, scheduler, num_blocks, first.block_size)
    validator = Validator(
        tokenizer=tokenizer,
        scheduler=scheduler,
        limits=config.limits,
        kv_capacity_tokens=num_blocks * first.block_size,
    )
    return ServerState(
        engine=engine,
        validator=validator,
        model_id=first.model_id,
        dtype=first.dtype,
        device_type=first.device.split(":")[0],
        num_shard=first.world_size,
        attention_backend=first.attention_backend,
        version=package_version(),
    )


async def serve(config: ServerConfig) -> None:
    """Run the whole server until interrupted."""
    executor = make_executor(config)
    client: ShardClient | None = None
    try:
        logger.info("starting {} shard(s) with the {} executor", config.shard.num_shard,
                    config.executor)
        addresses = await executor.start()
        client = ShardClient(addresses)
        await client.wait_ready(SHARD_START_TIMEOUT_S)
        state = await build_state(config, client)
        state.engine.start()
        server = _Server(
            uvicorn.Config(create_app(state), host=config.host, port=config.port,
                           log_level="warning", lifespan="off",
                           timeout_graceful_shutdown=config.graceful_timeout_s)
        )
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, _request_exit, server, state.engine, signum)
        grpc_server = None
        if config.grpc_port:
            grpc_server, grpc_port = await start_grpc_server(state, config.host, config.grpc_port)
            logger.info("serving the gRPC API on {}:{}", config.host, grpc_port)
        logger.info("serving {} on http://{}:{}", state.model_id, config.host, config.port)
        try:
            await server.serve()
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=5)
            await state.engine.stop()
    finally:
        if client is not None:
            await client.close()
        await executor.stop()
        logger.info("stopped")


def _request_exit(server: uvicorn.Server, engine: Engine, signum: int) -> None:
    """Stop admission: uvicorn closes its listening socket and waits up to
    ``--graceful-timeout`` for open requests (streams included) to finish."""
    logger.info("received {}, draining (graceful timeout {} s)", signal.Signals(signum).name,
                server.config.timeout_graceful_shutdown)
    engine.draining = True
    server.should_exit = True


def run(config: ServerConfig) -> None:
    """Blocking entry point of ``shardserve launch``."""
    asyncio.run(serve(config))
