"""Start one shard: load the model, serve ``ShardService`` over gRPC.

``python -m shard.server --model PATH [--port N ...]`` runs one shard as a plain
process and logs ``listening on HOST:PORT`` once it accepts calls. Flags default to
``SHARDSERVE_<FIELD>`` environment variables when set (see :func:`env_overrides`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Mapping, Sequence

import grpc
from loguru import logger

from shard.config import MiB, ShardConfig, env_overrides
from shard.model_runner import ModelRunner
from shard.pb import shard_pb2_grpc
from shard.progress import tqdm_safe_write
from shard.servicer import ShardServicer

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


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags; each maps onto a :class:`ShardConfig` field."""
    d = ShardConfig(model_path="-")
    p = argparse.ArgumentParser(
        prog="python -m shard.server", description="Run one shardserve shard."
    )
    p.add_argument("--model", dest="model_path", required=False, help="Hugging Face model folder")
    p.add_argument(
        "--model-id", default=d.model_id, help="name reported by Info (default: --model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-bytes", type=int, default=d.kv_cache_bytes, help="CPU KV cache budget"
    )
    p.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction)
    p.add_argument(
        "--cuda-graphs", default=d.cuda_graphs,
        help="decode batch sizes captured as CUDA graphs: auto, 0 (off) or e.g. 1,2,4,8,16",
    )
    p.add_argument(
        "--attention-backend", default=d.attention_backend, help="auto or a registry name"
    )
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--load-format", default=d.load_format, choices=["safetensors", "dummy"])
    p.add_argument("--json-output", dest="json_logs", action="store_true",
                   help="log JSON lines (each with the rank)")
    p.add_argument("--master-addr", default=d.master_addr, help="rank 0's IP (world size > 1)")
    p.add_argument(
        "--master-port", type=int, default=d.master_port, help="rendezvous port on rank 0"
    )
    return p


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ShardConfig, str, int]:
    """Parse flags (environment variables supply defaults) into (config, host, port).

    Args:
        environ: Where ``SHARDSERVE_*`` defaults are read; ``os.environ`` when None.

    Raises:
        SystemExit: on bad flags (argparse) or an invalid configuration.
    """
    parser = build_parser()
    parser.set_defaults(**env_overrides(environ))
    args = vars(parser.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    if not args.get("model_path"):
        parser.error("--model is required (or SHARDSERVE_MODEL_PATH)")
    try:
        return ShardConfig(**args), host, port
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def configure_logging(rank: int, json_logs: bool = False) -> None:
    """One stderr sink; every line carries the rank (JSON lines with ``json_logs``)."""
    logger.remove()
    logger.configure(extra={"rank": rank})
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
    asyncio.run(_serve(config, host, port))


if __name__ == "__main__":
    main()
