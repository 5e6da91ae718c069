"""The ``shardserve`` command.

Subcommands:
    launch   start the shards (Ray by default) and serve the HTTP and gRPC APIs
    prepare  convert the default model into the cache folder (done by ``launch`` too)

Every flag can come from an environment variable, ``SHARDSERVE_<FLAG>``
(``--kv-cache-bytes`` ← ``SHARDSERVE_KV_CACHE_BYTES``): :func:`apply_env_defaults`
walks the parser, so a new flag needs no code for it. Sizes take units (``1GiB``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger

from router.config import SchedulerConfig, ServerConfig, ValidationLimits, derive_budgets
from router.log import setup_logging
from router.model_files import prepare_default_model, resolve_model
from shard.config import ENV_PREFIX, ShardConfig, add_shard_flags, parse_bool, size_arg
from shard.layers.tp_layout import check_tp_size_for_folder

# The shard flags of ``launch``, defined with ShardConfig's fields (defaults, help, types).
_MODEL_SHARD_FLAGS = ("dtype", "device", "load_format")
_SHARD_FLAGS = ("attention_backend", "cuda_graphs", "pdl", "gemm_tuning", "gemm_tuning_cache",
                "block_size", "kv_cache_bytes", "gpu_memory_fraction")

# Shard fields whose router flag has another name: TGI's --num-shard, and the router's
# own log switch, which it hands to the shards.
SHARD_FLAG_SPELLINGS = {"world_size": "--num-shard", "json_logs": "--json-output"}


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Every ``launch`` flag. Each needs help text; the formatter adds its default,
    choices and environment variable (tests/unit/router/test_cli.py checks them all)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", "--model-id", dest="model", default=None, metavar="PATH",
                       help="the model to serve: a Hugging Face model folder, or ORG/NAME "
                       "already in the local Hugging Face cache; --model-id is TGI's name "
                       "for it (default: SmolLM2-135M-Instruct, converted once)")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names the model answers to in the OpenAI `model` field (another "
                       "is a 404); the first is reported by /info, /v1/models and responses "
                       "(default: the folder's name or the repository id)")
    add_shard_flags(model, _MODEL_SHARD_FLAGS)

    shards = parser.add_argument_group("shards")
    add_shard_flags(shards, {"world_size": SHARD_FLAG_SPELLINGS["world_size"]})
    shards.add_argument("--executor", default="ray", choices=["ray", "local"],
                        help="start shards as Ray actors or local processes")
    shards.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) "
                        "(default: start a local Ray instance)")
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
    add_shard_flags(shards, _SHARD_FLAGS)

    budgets = parser.add_argument_group("scheduling")
    for name in _DERIVED_BUDGETS:
        budgets.add_argument(_flag(name), *_PEER_SPELLINGS.get(name, ()), type=int, default=None,
                             help=_DERIVED_HELP[name])
    defaults = SchedulerConfig()
    budgets.add_argument("--max-batch-size", *_PEER_SPELLINGS["max_batch_size"], type=int,
                         default=defaults.max_batch_size, help="requests in the running batch")
    budgets.add_argument("--max-concurrent-requests", type=int,
                         default=defaults.max_concurrent_requests,
                         help="queued + running requests; more are refused with 429")
    budgets.add_argument("--waiting-served-ratio", type=float,
                         default=defaults.waiting_served_ratio,
                         help="while a batch runs, prefill newcomers once there are this many "
                         "per running request ...")
    budgets.add_argument("--max-waiting-tokens", type=int, default=defaults.max_waiting_tokens,
                         help="... or after this many decode steps since the last prefill")
    budgets.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                         help="reuse KV blocks of identical prompt prefixes")
    budgets.add_argument("--chunked-prefill", default="on", choices=["on", "off"],
                         help="split long prompts over steps shared with decodes")
    budgets.add_argument("--decode-during-prefill", default="on", choices=["on", "off"],
                         help="on: a step that prefills newcomers also decodes the running "
                         "batch; off: prefill first, the running batch decodes when nothing "
                         "more can be admitted or after --max-waiting-tokens prefill steps "
                         "in a row (running streams pause during prefills)")
    budgets.add_argument("--steps-in-flight", type=int, default=defaults.steps_in_flight,
                         choices=[1, 2],
                         help="shard steps sent ahead of the one being read: 1, or 2 for "
                         "more slack on a busy router (a stopped request then computes two "
                         "discarded tokens instead of one)")
    limits = ValidationLimits()
    budgets.add_argument("--max-stop-sequences", type=int, default=limits.max_stop_sequences,
                         help="stop strings per request")
    budgets.add_argument("--max-top-n-tokens", type=int, default=limits.max_top_n_tokens,
                         help="alternatives per token (top_n_tokens, logprobs, top_logprobs)")
    budgets.add_argument("--max-best-of", type=int, default=limits.max_best_of,
                         help="sequences per request (best_of, n)")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="interface of the HTTP and gRPC APIs")
    server.add_argument("--port", type=int, default=3000, help="HTTP port")
    server.add_argument("--grpc-port", type=int, default=3001,
                        help="port of the public gRPC API (0 = off)")
    server.add_argument("--json-output", action="store_true", help="log JSON lines")
    server.add_argument("--status-interval", type=float, default=5.0, metavar="SECONDS",
                        help="while busy, log throughput, running/waiting requests and KV "
                        "cache use this often (0 = never)")
    server.add_argument("--max-request-bytes", type=size_arg, default="1MiB", metavar="SIZE",
                        help="largest HTTP request body and public gRPC message: bytes or with "
                        "a unit (413 / RESOURCE_EXHAUSTED beyond)")
    server.add_argument("--graceful-timeout", type=int, default=30, metavar="SECONDS",
                        help="seconds running requests may take to finish after SIGTERM")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require `Authorization: Bearer <key>` on every HTTP route but "
                        "/health and /metrics, and the same gRPC metadata on every public gRPC "
                        "call but health checks; none = the APIs are open")
    server.add_argument("--metrics-require-api-key", default="off", choices=["on", "off"],
                        help="on: /metrics needs the --api-key too (off: open to scrapers, "
                        "as in vLLM and TGI)")
    server.add_argument("--api-server-count", type=int, default=None, metavar="N",
                        help="processes serving the HTTP and gRPC APIs beside the engine's "
                        "process, which then only schedules and steps the shards; 0 = the "
                        "APIs run in the engine's process (default: 1 when the shards run on "
                        "a GPU, 0 on CPU)")
    server.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="seconds a client has to send a request's headers, and again "
                        "its body; slower or idle connections are closed")


_DERIVED_BUDGETS = ("max_batch_prefill_tokens", "max_input_tokens", "max_total_tokens")
# Flags whose value the help never shows (it may come from the environment).
_SECRET_DESTS = frozenset({"api_key"})
_DERIVED_HELP = {
    "max_batch_prefill_tokens": "prompt tokens per prefill step, the chunk of chunked prefill "
    "(default: 512 on CPU, 2048 on GPU; max-input-tokens with --chunked-prefill off)",
    "max_input_tokens": "longest prompt (default: max-total-tokens - 1)",
    "max_total_tokens": "longest prompt + output (default: min(context, 4096, KV capacity))",
}


# vLLM's names of the same budgets, accepted as they are.
_PEER_SPELLINGS = {"max_total_tokens": ("--max-model-len",), "max_batch_size": ("--max-num-seqs",)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_names(action: argparse.Action) -> list[str]:
    """``SHARDSERVE_<FLAG>`` for each long spelling of ``action`` (``--model-id`` →
    ``SHARDSERVE_MODEL_ID``); none for ``--help``."""
    if action.default == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return []
    return [ENV_PREFIX + option[2:].upper().replace("-", "_")
            for option in action.option_strings if option.startswith("--")]


def _convert(action: argparse.Action, raw: str) -> Any:
    """``raw`` converted as if it were given on the command line for ``action``.

    Raises:
        ValueError: not a valid value (argparse.ArgumentTypeError included).
    """
    if action.nargs == 0:  # a switch such as --json-output
        return action.const if parse_bool(raw) else action.default
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    values = [convert(word) for word in (shlex.split(raw) if many else [raw])]
    for value in values:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    if many and not values:
        raise ValueError("expected at least one value")
    return values if many else values[0]


def apply_env_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str]
) -> None:
    """Let every flag of ``parser`` (and of its sub-commands) default to its
    ``SHARDSERVE_<FLAG>`` variable: values are parsed as on the command line (types,
    units, choices; switches take true/false; lists are space-separated), and a flag
    given on the command line still wins. Flags added later get it without more code.

    Raises:
        SystemExit: a variable holds an invalid value (the message names it).
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                apply_env_defaults(subparser, environ)
            continue
        for name in env_names(action):
            if name in environ:
                try:
                    action.default = _convert(action, environ[name])
                except (ValueError, argparse.ArgumentTypeError) as error:
                    parser.error(f"{name}={environ[name]!r}: {error}")
                break


# Variables read outside the flags (router.config.cache_dir).
_OTHER_ENV_NAMES = frozenset({ENV_PREFIX + "CACHE_DIR"})


def _all_env_names(parser: argparse.ArgumentParser) -> set[str]:
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                names |= _all_env_names(subparser)
        else:
            names.update(env_names(action))
    return names


def unknown_env_names(
    parser: argparse.ArgumentParser, environ: Mapping[str, str]
) -> list[tuple[str, str | None]]:
    """``SHARDSERVE_*`` variables in ``environ`` that no flag reads, each with the
    closest known name (or None): such a variable is ignored, and an operator who set
    ``SHARDSERVE_WORLD_SIZE`` (a shard field's name) should learn that the router's flag
    is ``--num-shard`` (``SHARDSERVE_NUM_SHARD``)."""
    known = _all_env_names(parser) | _OTHER_ENV_NAMES
    # shard fields whose router flag is spelled otherwise
    aliases = {ENV_PREFIX + field.upper(): ENV_PREFIX + flag[2:].upper().replace("-", "_")
               for field, flag in SHARD_FLAG_SPELLINGS.items()}
    unknown = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        # compared without the common prefix, which would make every name look close
        bare = {known_name[len(ENV_PREFIX):]: known_name for known_name in known}
        close = difflib.get_close_matches(name[len(ENV_PREFIX):], sorted(bare), n=1)
        unknown.append((name, aliases.get(name) or (bare[close[0]] if close else None)))
    return unknown


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, its choices and its variables."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        names = env_names(action)
        if not names:
            return text
        extras = []
        if action.choices is not None:
            extras.append("choices: " + ", ".join(map(str, action.choices)))
        if "(default:" not in text:
            extras.append(f"default: {_shown_default(action)}")
        extras.append("env: " + ", ".join(names))
        # The flag's own help may use argparse's %(default)s; what is added here is literal.
        return f"{text} [{'; '.join(extras).replace('%', '%%')}]"


def _shown_default(action: argparse.Action) -> str:
    value = action.default
    if action.dest in _SECRET_DESTS:
        return "set (hidden)" if value else "none"
    if action.nargs == 0:
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if action.metavar == "SIZE" and isinstance(value, int):
        return _size_text(value)
    return str(value)


def _size_text(size: int) -> str:
    """``size`` bytes in the largest IEC unit that divides it (536870912 → ``512MiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Argument parser of the ``shardserve`` command; flags default to their
    ``SHARDSERVE_<FLAG>`` variables in ``environ`` (``os.environ`` when None).

    Raises:
        SystemExit: a ``SHARDSERVE_<FLAG>`` variable holds an invalid value.
    """
    parser = argparse.ArgumentParser(prog="shardserve", description="LLM text-generation server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_launch_flags(sub.add_parser("launch", help="start shards and serve the HTTP API",
                                     formatter_class=_HelpFormatter,
                                     description="Start the shards and serve the HTTP and "
                                     "gRPC APIs. Every flag can also come from the environment "
                                     "variable shown with it; the command line wins."))
    sub.add_parser("prepare", help="convert the default model into the cache folder")
    apply_env_defaults(parser, os.environ if environ is None else environ)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` (``launch``, ``prepare``) under ``parser``."""
    for action in parser._actions:  # argparse names no public way to its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def parse_command_line(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` (:func:`build_parser`).

    Raises:
        SystemExit: invalid arguments; an unknown flag is reported by its command's own
            parser, with that command's usage (argparse would print the top level's).
    """
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parser(parser, args.command).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    return args


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed ``launch`` flags into a validated :class:`ServerConfig`.

    Raises:
        ValueError: a flag has an invalid value (the message names it).
        FileNotFoundError: ``--model`` is not a model folder.
    """
    if args.num_shard < 1:
        raise ValueError("--num-shard must be at least 1")
    files = resolve_model(args.model)
    check_tp_size_for_folder(files.path, args.num_shard)  # fail before starting any shard
    names = tuple(args.served_model_name or [files.model_id])
    shard = ShardConfig(
        model_path=str(files.path), model_id=names[0], world_size=args.num_shard,
        json_logs=args.json_output,
        **{name: getattr(args, name) for name in (*_MODEL_SHARD_FLAGS, *_SHARD_FLAGS)},
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
        chunked_prefill=chunked,
        decode_during_prefill=args.decode_during_prefill == "on",
        steps_in_flight=args.steps_in_flight,
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
        max_request_bytes=args.max_request_bytes, served_model_names=names,
        api_key=args.api_key, header_timeout_s=args.header_timeout,
        metrics_require_api_key=args.metrics_require_api_key == "on",
        status_interval_s=args.status_interval, step_timeout_s=args.step_timeout,
        api_server_count=args.api_server_count,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardserve`` command; returns the exit code."""
    parser = build_parser()
    args = parse_command_line(parser, argv)
    setup_logging(json_output=getattr(args, "json_output", False))
    for name, close in unknown_env_names(parser, os.environ):
        logger.warning("{} is not a shardserve setting and is ignored{}", name,
                       f" (did you mean {close}?)" if close else "")
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
