"""What the deploy tests share: the rendered manifests and the server's own CLI and routes."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from router.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERAY_SCHEMAS = REPO.parent / "shared" / "schemas" / "kuberay"

# Every kustomization under deploy/: a new overlay is rendered and checked automatically.
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))

Object = dict[str, Any]


def kustomization_id(directory: Path) -> str:
    return str(directory.relative_to(DEPLOY))


def launch_parser() -> argparse.ArgumentParser:
    """The ``shardserve launch`` sub-parser of the real CLI."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    launch: argparse.ArgumentParser = subparsers.choices["launch"]
    launch.exit_on_error = False
    return launch


def parse_launch_args(args: list[str]) -> argparse.Namespace:
    """Parse ``args`` as the real ``shardserve launch`` would; an unknown flag or a bad
    value fails the test (argparse raises instead of exiting)."""
    namespace, unknown = launch_parser().parse_known_args(args)
    if unknown:
        raise AssertionError(f"flags shardserve launch does not know: {unknown}")
    return namespace


def expand_env_refs(args: list[str], env: list[Object]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of container args from the container's env."""
    values = {item["name"]: item["value"] for item in env if "value" in item}

    def expand(arg: str) -> str:
        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            assert name in values, f"args reference $({name}), which env does not define"
            return values[name]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, arg)

    return [expand(arg) for arg in args]


def split_entrypoint(entrypoint: str) -> list[str]:
    """A shell command line as words."""
    return shlex.split(entrypoint)


def router_paths() -> set[str]:
    """Every HTTP path the router's FastAPI app declares (its OpenAPI document).

    ``create_app`` only keeps the state for the request handlers (it reads a few
    attributes while building), so a stand-in state is enough to list the routes.
    """
    from unittest.mock import MagicMock

    from router.api.app import create_app

    app = create_app(MagicMock(version="0"))
    return set(app.openapi()["paths"])


def by_kind(objects: list[Object], kind: str) -> list[Object]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[Object], kind: str) -> Object:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def container_port(container: Object, port: int | str) -> int:
    """The number a probe or Service targetPort means on ``container`` (name or number)."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in container.get("ports", [])), port
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {container['name']} has no port named {port!r}"
    return int(numbers[0])


def quantity_gib(quantity: str) -> float:
    """A Kubernetes memory quantity in GiB (binary suffixes only, as deploy/ uses)."""
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    raise AssertionError(f"use a binary suffix (Mi, Gi) in {quantity!r}")
