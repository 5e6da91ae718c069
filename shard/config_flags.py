"""The command lines made from :class:`~shard.config.ShardConfig`'s flag definitions:
``python -m shard.server``'s (:func:`shard_parser`, :func:`config_from_args`), the argv
the local executor starts a rank with (:func:`shard_argv`), the shard flags of
``shardserve launch`` (:func:`add_shard_flags`), and the ``SHARDSERVE_<FIELD>``
environment variables (:func:`env_overrides`). Like :mod:`shard.config`, it imports no
torch, so the router can import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from shard.config import ENV_PREFIX, ShardConfig, ShardFlag, parse_bool

_FIELDS = {spec.name: spec for spec in dataclasses.fields(ShardConfig)}


def shard_flag(name: str) -> ShardFlag:
    """The :class:`ShardFlag` of field ``name`` of :class:`ShardConfig`."""
    flag: ShardFlag = _FIELDS[name].metadata["flag"]
    return flag


def flag_name(name: str) -> str:
    """The spelling of field ``name``'s flag (``kv_cache_bytes`` → ``--kv-cache-bytes``)."""
    return shard_flag(name).name or "--" + name.replace("_", "-")


def add_shard_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Sequence[str] | Mapping[str, str],
    dest_is_field: bool = False,
) -> None:
    """Add the flags of :class:`ShardConfig` fields ``names`` to ``parser``, with the
    fields' defaults.

    Args:
        names: Field names, or field name → another spelling of its flag (the router
            calls ``world_size`` ``--num-shard``, as TGI does).
        dest_is_field: Parse each flag into its field's name; otherwise argparse's
            name from the spelling (``--num-shard`` → ``num_shard``).
    """
    spellings = names if isinstance(names, Mapping) else {name: "" for name in names}
    for name, spelling in spellings.items():
        spec = shard_flag(name)
        default = _FIELDS[name].default
        options: dict[str, Any] = {
            "help": spec.help, "default": None if default is dataclasses.MISSING else default,
        }
        if dest_is_field:
            options["dest"] = name
        if spec.type is bool:
            options["action"] = "store_true"
        else:
            options.update(type=spec.type, choices=spec.choices, metavar=spec.metavar)
        parser.add_argument(spelling or flag_name(name), **options)


def shard_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``python -m shard.server``: one a :class:`ShardConfig`
    field, plus ``--host`` and ``--port``. ``--model`` has no default here (it may come
    from ``SHARDSERVE_MODEL_PATH``); :func:`config_from_args` requires it."""
    parser = argparse.ArgumentParser(
        prog="python -m shard.server", description="Run one shardserve shard."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    add_shard_flags(parser, list(_FIELDS), dest_is_field=True)
    return parser


def shard_argv(config: ShardConfig, host: str, port: int) -> list[str]:
    """The ``python -m shard.server`` arguments that start ``config`` on ``host:port``
    (every field spelled out; :func:`config_from_args` parses them back to ``config``)."""
    argv = ["--host", host, "--port", str(port)]
    for spec in dataclasses.fields(ShardConfig):
        value = getattr(config, spec.name)
        if shard_flag(spec.name).type is bool:
            argv += [flag_name(spec.name)] if value else []
        else:
            argv += [flag_name(spec.name), str(value)]
    return argv


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ShardConfig, str, int]:
    """Parse ``python -m shard.server`` flags (``SHARDSERVE_<FIELD>`` variables in
    ``environ``, ``os.environ`` when None, supply defaults) into (config, host, port).

    Raises:
        SystemExit: on bad flags (argparse) or an invalid configuration.
    """
    parser = shard_parser()
    try:
        parser.set_defaults(**env_overrides(environ))
    except ValueError as error:
        parser.error(str(error))
    args = vars(parser.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    if not args.get("model_path"):
        parser.error("--model is required (or SHARDSERVE_MODEL_PATH)")
    try:
        config = ShardConfig(**args)
        config.check_rendezvous()
    except ValueError as exc:
        parser.error(str(exc))
    return config, host, port


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Read ``SHARDSERVE_<FIELD>`` variables for :class:`ShardConfig` fields.

    This is the only function in shardserve's shard that reads the environment.

    Args:
        environ: Mapping to read; ``os.environ`` when None.

    Returns:
        ``{field_name: value}`` converted as the field's flag converts it, only for
        variables set, e.g. ``SHARDSERVE_ATTENTION_BACKEND=torch`` →
        ``{"attention_backend": "torch"}``, ``SHARDSERVE_KV_CACHE_BYTES=1GiB`` →
        ``{"kv_cache_bytes": 1073741824}``.

    Raises:
        ValueError: when a value does not parse as the field's type (names the variable).
    """
    env = os.environ if environ is None else environ
    out: dict[str, object] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key not in env:
            continue
        raw = env[key]
        convert = shard_flag(name).type
        try:
            out[name] = parse_bool(raw) if convert is bool else convert(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{key}={raw!r} is not a valid {name}: {exc}") from exc
    return out
