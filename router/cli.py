"""The ``shardserve`` command.

Subcommands:
    launch   start the shards (Ray by default) and serve the HTTP and gRPC APIs
    serve    the same as N replicas on Ray Serve (:mod:`router.serve.app`)
    prepare  convert the default model into the cache folder (done by ``launch`` too)
    client   ask a running server's public gRPC API for a completion
             (:mod:`router.grpc_api.client`)

Every flag can come from an environment variable, ``SHARDSERVE_<FLAG>``
(``--kv-cache-bytes`` ← ``SHARDSERVE_KV_CACHE_BYTES``): :func:`apply_env_defaults`
walks the parser, so a new flag needs no code for it. Sizes take units (``1GiB``).
The flags and their defaults are defined once, with the config dataclasses' fields
(:mod:`router.config`, :class:`shard.config.ShardConfig`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loguru import logger

from router.config import (
    SchedulerConfig,
    ServerConfig,
    ValidationLimits,
    config_flags,
    derive_budgets,
    speculative_tokens,
)
from router.grpc_api.client import DEFAULT_TEXTS as CLIENT_DEFAULT_TEXTS
from router.grpc_api.client import add_client_flags, run_client
from router.log import setup_logging
from router.model_files import check_weights, prepare_default_model, resolve_model
from router.serve.config import ServeConfig
from shard.config import ENV_PREFIX, ShardConfig, parse_bool
from shard.config_flags import add_shard_flags
from shard.layers.tp_layout import check_tp_size_for_folder
from shard.tokenizer_files import check_same_vocabulary

# The shard flags of ``launch``, defined with ShardConfig's fields (defaults, help, types).
_MODEL_SHARD_FLAGS = ("dtype", "device", "load_format", "quantization")
_SHARD_FLAGS = ("attention_backend", "cuda_graphs", "pdl", "gemm_tuning", "gemm_tuning_cache",
                "block_size", "kv_cache_bytes", "kv_cache_dtype", "gpu_memory_fraction",
                "step_trace_dir", "speculative_method", "speculative_model", "ngram_max",
                "ngram_min")

# Shard fields whose router flag has another name: TGI's --num-shard, and the router's
# own log switch, which it hands to the shards.
SHARD_FLAG_SPELLINGS = {"world_size": "--num-shard", "json_logs": "--json-output"}


def _dest(spelling: str) -> str:
    """argparse's name of a flag's value: ``--placement-timeout`` → ``placement_timeout``."""
    return spelling.removeprefix("--").replace("-", "_")


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Every ``launch`` flag: those of config fields (:func:`add_config_flags`,
    :func:`shard.config_flags.add_shard_flags`) and ``--model``. Each needs help text
    and, if it takes a value, a metavar naming its unit or kind; the formatter adds its
    default, choices and environment variable (tests/unit/router/test_cli.py checks them
    all)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", "--model-id", dest="model", default=None, metavar="PATH",
                       help="the model to serve: a Hugging Face model folder, or ORG/NAME "
                       "already in the local Hugging Face cache; --model-id is TGI's name "
                       "for it")
    add_config_flags(model, ServerConfig, ("served_model_names",))
    add_shard_flags(model, _MODEL_SHARD_FLAGS)

    shards = parser.add_argument_group("shards")
    add_shard_flags(shards, {"world_size": SHARD_FLAG_SPELLINGS["world_size"]})
    add_config_flags(shards, ServerConfig, ("executor", "ray_address", "placement",
                                            "placement_timeout_s", "max_restarts",
                                            "step_timeout_s", "master_port"))
    add_shard_flags(shards, _SHARD_FLAGS)

    scheduling = parser.add_argument_group("scheduling")
    add_config_flags(scheduling, SchedulerConfig)
    add_config_flags(scheduling, ValidationLimits)

    server = parser.add_argument_group("server")
    add_config_flags(server, ServerConfig, ("host", "port", "grpc_port"))
    add_shard_flags(server, {"json_logs": SHARD_FLAG_SPELLINGS["json_logs"]})
    add_config_flags(server, ServerConfig, ("status_interval_s", "max_request_bytes",
                                            "graceful_timeout_s", "api_key",
                                            "metrics_require_api_key",
                                            "api_server_count", "header_timeout_s"))
    # ShardConfig's flags name no unit (shard/config.py serves python -m shard.server
    # too): launch's --help names them here.
    for action in parser._actions:
        action.metavar = _SHARD_METAVARS.get(action.dest, action.metavar)


# Units of the shard flags of launch that take a number or a free text.
_SHARD_METAVARS = {"num_shard": "N", "block_size": "TOKENS", "gpu_memory_fraction": "FRACTION",
                   "device": "DEVICE"}
# Defaults in words: of --model, and of config fields derived at start-up.
_DEFAULT_TEXTS = {"model": "SmolLM2-135M-Instruct, converted once"} | CLIENT_DEFAULT_TEXTS | {
    _dest(flag.spelling(name)): flag.default_text
    for config_class in (SchedulerConfig, ValidationLimits, ServerConfig, ServeConfig)
    for name, (flag, _) in config_flags(config_class).items() if flag.default_text
}
# Flags whose value the help never shows (it may come from the environment).
_SECRET_DESTS = frozenset(
    _dest(flag.spelling(name))
    for config_class in (SchedulerConfig, ValidationLimits, ServerConfig, ServeConfig)
    for name, (flag, _) in config_flags(config_class).items() if flag.secret
)
_DERIVED_BUDGETS = ("speculative_disable_batch_size", "max_batch_prefill_tokens",
                    "max_input_tokens", "max_total_tokens",
                    "max_batch_size", "waiting_served_ratio", "max_concurrent_requests")


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_class: type,
    names: Sequence[str] | None = None,
) -> None:
    """Add the flags of ``config_class``'s fields ``names`` (all its fields that are
    flags when None) to ``parser``, each with its field's default: ``on`` / ``off`` for
    a bool field, none for a field whose :class:`~router.config.Flag` has a
    ``default_text`` (the value is derived at start-up).

    Raises:
        KeyError: a name is not a field with a flag.
    """
    flags = config_flags(config_class)
    for name in flags if names is None else names:
        flag, default = flags[name]
        options: dict[str, Any] = {"help": flag.help, "metavar": flag.metavar}
        if flag.type is bool:
            options.update(choices=("on", "off"), default="on" if default else "off")
        else:
            options.update(type=flag.type, choices=flag.choices, nargs=flag.nargs,
                           default=None if flag.default_text else default)
        parser.add_argument(flag.spelling(name), *flag.aliases, **options)


def config_values(config_class: type, args: argparse.Namespace) -> dict[str, Any]:
    """Field name → parsed value, for each field of ``config_class`` that is a flag
    (``on`` / ``off`` as bools, lists as tuples)."""
    values: dict[str, Any] = {}
    for name, (flag, _) in config_flags(config_class).items():
        value = getattr(args, _dest(flag.spelling(name)))
        if flag.type is bool:
            value = value == "on"
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return values


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
    """Each flag's help ends the same way: ``[choices: …; default: …; env: …]``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        names = env_names(action)
        if not names:
            return text
        extras = []
        if action.choices is not None:
            extras.append("choices: " + ", ".join(map(str, action.choices)))
        extras.append(f"default: {_shown_default(action)}")
        extras.append("env: " + ", ".join(names))
        # The flag's own help may use argparse's %(default)s; what is added here is literal.
        return f"{text} [{'; '.join(extras).replace('%', '%%')}]"


def _shown_default(action: argparse.Action) -> str:
    """The default of ``action`` as ``--help`` writes it: a size with its unit, a float
    without a trailing ``.0``, a switch as on/off, a derived default in words."""
    value = action.default
    if action.dest in _SECRET_DESTS:
        return "set (hidden)" if value else "none"
    if action.nargs == 0:
        return "on" if value else "off"
    if value is None:
        return _DEFAULT_TEXTS.get(action.dest, "none")
    if value == "":
        return "empty"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    if action.metavar == "SIZE" and isinstance(value, int):
        return _size_text(value)
    if isinstance(value, float):
        return f"{value:g}"
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
    serve = sub.add_parser("serve", help="serve N replicas (each with its own shards) on "
                           "Ray Serve", formatter_class=_HelpFormatter,
                           description="Serve --replicas replicas of the server, each a "
                           "router with its own shard group, as a Ray Serve application "
                           "routed by prefix-cache affinity and load. Takes launch's flags "
                           "too; --port and --grpc-port are Ray Serve's proxies'.")
    _add_launch_flags(serve)
    add_config_flags(serve.add_argument_group("replicas"), ServeConfig)
    sub.add_parser("prepare", help="convert the default model into the cache folder")
    add_client_flags(sub.add_parser("client", help="ask a running server for a completion "
                                    "through its public gRPC API",
                                    formatter_class=_HelpFormatter,
                                    description="Continue PROMPT (greedy) through a running "
                                    "server's public gRPC API and write the text to stdout."))
    apply_env_defaults(parser, os.environ if environ is None else environ)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` (``launch``, ``prepare``, ``client``) under ``parser``."""
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
    shard_flags = {name: getattr(args, name) for name in (*_MODEL_SHARD_FLAGS, *_SHARD_FLAGS)}
    if args.speculative_model:  # a draft model: the method is implied, the folder checked
        draft = resolve_model(args.speculative_model, flag="--speculative-model").path
        if args.load_format != "dummy":
            check_weights(draft, "--speculative-model")
        check_same_vocabulary(files.path, draft)
        shard_flags["speculative_model"] = str(draft)
        if shard_flags["speculative_method"] == "none":
            shard_flags["speculative_method"] = "draft"
    shard = ShardConfig(
        model_path=str(files.path), model_id=names[0], world_size=args.num_shard,
        json_logs=args.json_output, **shard_flags,
    )
    scheduling = config_values(SchedulerConfig, args)
    scheduling["num_speculative_tokens"] = speculative_tokens(
        scheduling["num_speculative_tokens"], shard.speculative_method)
    budget_flags = {name: scheduling.pop(name) for name in _DERIVED_BUDGETS}
    # Validate the given budgets now (placeholders for the derived ones).
    placeholders: dict[str, Any] = derive_budgets(
        budget_flags, max_position_embeddings=1 << 30,
        chunked_prefill=scheduling["chunked_prefill"])
    server = config_values(ServerConfig, args) | {"served_model_names": names}
    return ServerConfig(
        shard=shard, scheduler=SchedulerConfig(**placeholders, **scheduling),
        limits=ValidationLimits(**config_values(ValidationLimits, args)),
        budget_flags=budget_flags, **server,
    )


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Turn parsed ``serve`` flags into a validated :class:`ServeConfig`.

    Raises:
        ValueError: a flag has an invalid value (the message names it).
    """
    return ServeConfig(**config_values(ServeConfig, args))


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
    if args.command == "client":
        return run_client(args)
    try:
        config = config_from_args(args)
        serve_config = serve_config_from_args(args) if args.command == "serve" else None
    except (ValueError, FileNotFoundError) as error:
        logger.error("{}", error)
        return 2
    if serve_config is not None:
        from router.serve.app import run as run_replicas

        return run_replicas(config, serve_config)
    from router.launcher import run
    from router.shard_client import ShardError
    from router.startup_errors import StartupError

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
