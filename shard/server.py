"""Start one shard: load the model, serve ``ShardService`` over gRPC.

``python -m shard.server --model PATH [--port N ...]`` runs one shard as a plain
process and logs ``listening on HOST:PORT`` once it accepts calls. Its flags are
defined with :class:`~shard.config.ShardConfig` and default to ``SHARDSERVE_<FIELD>``
environment variables when set (see :func:`~shard.config_flags.config_from_args`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from loguru import logger

from shard.config import MiB, ShardConfig
from shard.config_flags import config_from_args
from shard.model_runner import ModelRunner
from shard.pb import shard_pb2_grpc
from shard.progress import tqdm_safe_write
from shard.servicer import ShardServicer

__all__ = ["config_from_args", "configure_logging", "main", "start_server", "watch_parent"]

# How often the parent watch checks that the shard's parent is still the one it was
# started by, seconds.
PARENT_POLL_S = 1.0

MAX_MESSAGE_BYTES = 256 * MiB
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


async def start_server(
    config: ShardConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """Load the model (in a worker thread) and start serving.

    Args:
        config: shard configuration.
        host: interface to bind.
        port: TCP port; 0 picks a free one.

    Returns:
        (server, bound port). Stop it with ``await server.stop(grace)``.

    Raises:
        ValueError: invalid model or configuration.
        RuntimeError: the address cannot be bound.
    """
    log = logger.bind(rank=config.rank)
    log.info("loading model from {} ({})", config.model_path, config.load_format)
    runner = await asyncio.to_thread(ModelRunner, config)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    shard_pb2_grpc.add_ShardServiceServicer_to_server(ShardServicer(runner), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    await server.start()
    log.info("listening on {}:{}", host, bound)
    return server, bound


def _name_main_module(record: Any) -> None:
    if record["name"] == "__main__":
        record["name"] = __spec__.name if __spec__ is not None else "shard.server"


def configure_logging(rank: int, json_logs: bool = False) -> None:
    """One stderr sink; every line carries the rank (JSON lines with ``json_logs``)."""
    logger.remove()
    # run as ``python -m shard.server`` this module is __main__; its lines name it
    logger.configure(extra={"rank": rank}, patcher=_name_main_module)
    # Through tqdm, so a progress bar on the terminal (warm-up) is redrawn below lines.
    if json_logs:
        logger.add(tqdm_safe_write, serialize=True)
        return
    logger.add(
        tqdm_safe_write,
        format=(
            "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | shard rank={extra[rank]} | "
            "{name}:{line} - {message}"
        ),
    )


def watch_parent(parent_pid: int, rank: int,
                 poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """Stop this process once ``parent_pid`` is no longer its parent: the process that
    started it exited, however it ended (a SIGKILL included), and this one was handed
    to another parent. A shard started in a session of its own (as the local executor
    starts them, so that Ctrl-C reaches the launcher first) would otherwise outlive a
    launcher that could not stop it, and keep its memory (a GPU's, for one).

    Checks ``os.getppid()`` every ``poll_s`` seconds on a daemon thread, from before
    the model loads; then sends SIGTERM to this process: the graceful stop once the
    server runs, the default action (exit) while the model still loads.

    Returns:
        The watching thread, or None when ``parent_pid`` is 0 (no watch).
    """
    if parent_pid <= 0:
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        logger.bind(rank=rank).warning(
            "the process that started this shard ({}) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


async def _serve(config: ShardConfig, host: str, port: int) -> None:
    server, _ = await start_server(config, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.bind(rank=config.rank).info("shutting down")
    await server.stop(grace=5)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m shard.server``."""
    config, host, port = config_from_args(argv)
    configure_logging(config.rank, config.json_logs)
    watch_parent(config.parent_pid, config.rank)
    asyncio.run(_serve(config, host, port))
    # Stopped cleanly and logged so. Leave without the interpreter's teardown: triton's
    # nanobind extension reports "leaked" objects then, dozens of lines in the
    # server's log with no newline at the end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
