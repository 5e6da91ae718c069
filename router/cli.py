"""The ``shardserve`` command.

Subcommands:
    launch   start the shards (Ray by default) and serve the HTTP and gRPC APIs
    prepare  convert the default model into the cache folder (done by ``launch`` too)
"""

from __future__ import annotations

import argparse
import sys

from loguru import logger

from router.config import (
    SchedulerConfig,
    ServerConfig,
    ShardLaunchConfig,
    ValidationLimits,
    derive_budgets,
    env_default,
)
from router.log import setup_logging
from router.model_files import prepare_default_model, resolve_model
from shard.layers.tp_layout import check_tp_size_for_folder


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    model.add_argument("--model-id", default=None, help="name reported by /info")
    model.add_argument("--dtype", default="auto",
                       help="float32 | bfloat16 | float16 | auto (float32 on CPU, bf16 on GPU)")
    model.add_argument("--device", default="auto", help="cpu | cuda | auto")
    model.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])

    shards = parser.add_argument_group("shards")
    shards.add_argument("--num-shard", type=int, default=1, help="tensor-parallel ranks")
    shards.add_argument("--executor", default="ray", choices=["ray", "local"],
                        help="start shards as Ray actors or local processes")
    shards.add_argument("--ray-address", default=None,
                        help="join this Ray cluster instead of starting one (e.g. auto)")
    shards.add_argument("--placement", default="pack", choices=["pack", "spread"],
                        help="Ray placement of the ranks: pack onto few nodes, or one per node")
    shards.add_argument("--placement-timeout", type=float, default=300.0,
                        help="seconds to wait for the Ray placement group (what is missing "
                        "is logged every 10 s), then exit with an error")
    shards.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of the shard group after a rank dies, then exit")
    shards.add_argument("--step-timeout", type=float, default=0.0,
                        help="seconds a prefill or decode step may take before its shard "
                        "group counts as hung and is restarted (0 = adaptive: max(30, "
                        "10 x the slowest step seen, Warmup included))")
    shards.add_argument("--master-port", type=int, default=0,
                        help="torch.distributed rendezvous port on rank 0 (0 = a free one)")
    shards.add_argument("--attention-backend",
                        default=env_default("attention_backend", "torch"),
                        help="attention implementation (env SHARDSERVE_ATTENTION_BACKEND)")
    shards.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    shards.add_argument("--kv-cache-bytes", type=int, default=512 * 1024 * 1024,
                        help="KV cache size per rank on CPU, bytes")
    shards.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                        help="share of GPU memory for weights, activations and KV cache")

    budgets = parser.add_argument_group("scheduling")
    for name in _DERIVED_BUDGETS:
        budgets.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                             help=_DERIVED_HELP[name])
    defaults = SchedulerConfig()
    for name in ("max_batch_size", "max_concurrent_requests", "max_waiting_tokens"):
        budgets.add_argument("--" + name.replace("_", "-"), type=int,
                             default=getattr(defaults, name))
    budgets.add_argument("--waiting-served-ratio", type=float,
                         default=defaults.waiting_served_ratio)
    budgets.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                         help="reuse KV blocks of identical prompt prefixes")
    budgets.add_argument("--chunked-prefill", default="on", choices=["on", "off"],
                         help="split long prompts over steps shared with decodes")
    limits = ValidationLimits()
    for name in ("max_stop_sequences", "max_top_n_tokens", "max_best_of"):
        budgets.add_argument("--" + name.replace("_", "-"), type=int,
                             default=getattr(limits, name))

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, default=3000, help="HTTP port")
    server.add_argument("--grpc-port", type=int, default=3001,
                        help="port of the public gRPC API (0 = off)")
    server.add_argument("--json-output", action="store_true", help="log JSON lines")
    server.add_argument("--max-request-bytes", type=int, default=1 << 20,
                        help="largest HTTP request body and public gRPC message, bytes "
                        "(413 / RESOURCE_EXHAUSTED beyond)")
    server.add_argument("--graceful-timeout", type=int, default=30,
                        help="seconds running requests may take to finish after SIGTERM")


_DERIVED_BUDGETS = ("max_batch_prefill_tokens", "max_input_tokens", "max_total_tokens")
_DERIVED_HELP = {
    "max_batch_prefill_tokens": "prompt tokens per prefill step, the chunk of chunked prefill "
    "(default: 512 on CPU, 2048 on GPU; max-input-tokens with --chunked-prefill off)",
    "max_input_tokens": "longest prompt (default: max-total-tokens - 1)",
    "max_total_tokens": "longest prompt + output (default: min(context, 4096, KV capacity))",
}


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of the ``shardserve`` command."""
    parser = argparse.ArgumentParser(prog="shardserve", description="LLM text-generation server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_launch_flags(sub.add_parser("launch", help="start shards and serve the HTTP API"))
    sub.add_parser("prepare", help="convert the default model into the cache folder")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed ``launch`` flags into a validated :class:`ServerConfig`.

    Raises:
        ValueError: a flag has an invalid value (the message names it).
        FileNotFoundError: ``--model`` is not a model folder.
    """
    files = resolve_model(args.model, args.model_id)
    check_tp_size_for_folder(files.path, args.num_shard)  # fail before starting any shard
    shard = ShardLaunchConfig(
        model_path=str(files.path), model_id=files.model_id, num_shard=args.num_shard,
        dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_fraction=args.gpu_memory_fraction, load_format=args.load_format,
        json_logs=args.json_output,
    )
    budget_flags = {name: getattr(args, name) for name in _DERIVED_BUDGETS}
    # Validate the given budgets now (placeholders for the derived ones).
    chunked = args.chunked_prefill == "on"
    placeholders = derive_budgets(budget_flags, max_position_embeddings=1 << 30,
                                  chunked_prefill=chunked)
    scheduler = SchedulerConfig(
        **placeholders,
        max_batch_size=args.max_batch_size,
        max_concurrent_requests=args.max_concurrent_requests,
        waiting_served_ratio=args.waiting_served_ratio,
        max_waiting_tokens=args.max_waiting_tokens,
        prefix_caching=args.prefix_caching == "on",
        chunked_prefill=args.chunked_prefill == "on",
    )
    limits = ValidationLimits(
        max_stop_sequences=args.max_stop_sequences, max_top_n_tokens=args.max_top_n_tokens,
        max_best_of=args.max_best_of,
    )
    return ServerConfig(
        shard=shard, scheduler=scheduler, limits=limits, host=args.host, port=args.port,
        grpc_port=args.grpc_port, executor=args.executor, ray_address=args.ray_address,
        placement=args.placement, placement_timeout_s=args.placement_timeout,
        max_restarts=args.max_restarts, master_port=args.master_port,
        graceful_timeout_s=args.graceful_timeout, budget_flags=budget_flags,
        step_timeout_s=args.step_timeout,
        max_request_bytes=args.max_request_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardserve`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    setup_logging(json_output=getattr(args, "json_output", False))
    if args.command == "prepare":
        files = prepare_default_model()
        logger.info("default model at {}", files.path)
        return 0
    try:
        config = config_from_args(args)
    except (ValueError, FileNotFoundError) as error:
        logger.error("{}", error)
        return 2
    from router.executors import StartupError
    from router.launcher import run
    from router.shard_client import ShardError

    try:
        return run(config)
    except KeyboardInterrupt:
        pass
    except (ShardError, StartupError) as error:
        # Start-up failures (e.g. Warmup out of memory) name the flag to change.
        logger.error("start-up failed: {}", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
