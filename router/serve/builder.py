"""The Ray Serve application builder of ``shardserve serve``, for a Serve config file or
a KubeRay ``RayService`` (``import_path: router.serve.builder:app_builder``): the same
flags as the command, given as one line in ``args.flags``. Apart from
:mod:`router.serve.app` because it reads the flags with the command's parser
(:mod:`router.cli`, which imports :mod:`router.serve.app`).
"""

from __future__ import annotations

import shlex
from typing import Any

from router.cli import build_parser, config_from_args, serve_config_from_args
from router.serve.app import build_app


def app_builder(args: dict[str, str]) -> Any:
    """Ray Serve application builder (``import_path: router.serve.builder:app_builder``)
    for a config file or a KubeRay RayService: ``args["flags"]`` holds the
    ``shardserve serve`` flags as one command line.

    Raises:
        ValueError: a flag is invalid (the message names it), or ``--rolling-restart``
            is given (a changed config file is the update there).
    """
    argv = ["serve", *shlex.split(args.get("flags", ""))]
    parsed = build_parser().parse_args(argv)
    serve_config = serve_config_from_args(parsed)
    if serve_config.rolling_restart:
        raise ValueError(
            "--rolling-restart is for the command line: deploying a changed config "
            "file already replaces the replicas one at a time"
        )
    return build_app(config_from_args(parsed), serve_config)
