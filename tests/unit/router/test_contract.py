"""The router reaches into the shard package only for the contract both sides share:
the generated stubs, the shard configuration (with its flags and the command lines made
from them), the tensor-parallel layout check, the default model's marker and the
checks of a model folder's files; never the shard runtime, and never torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# torch-free modules of the shard package that the router may import.
CONTRACT = {"shard", "shard.config", "shard.config_flags", "shard.default_model",
            "shard.sampling_types", "shard.tokenizer_files", "shard.weight_files",
            "shard.layers", "shard.layers.tp_layout", "shard.pb", "shard.pb.shard_pb2",
            "shard.pb.shard_pb2_grpc",
            # the trace file writer both sides use (no step message carries a trace)
            "shard.step_trace"}
# Imported by the Ray executor only to name the actor class; the actor loads the shard
# runtime in its own process.
RAY_ENTRY = "shard.actor"


def shard_imports(path: Path) -> set[str]:
    """Every ``shard...`` module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in CONTRACT)
    return {name for name in found if name == "shard" or name.startswith("shard.")}


def test_router_source_names_only_contract_modules_of_the_shard() -> None:
    for path in sorted((REPO / "router").rglob("*.py")):
        outside = shard_imports(path) - CONTRACT - {RAY_ENTRY}
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"


def test_ray_entry_imports_without_the_shard_runtime() -> None:
    run_blocked(f"import {RAY_ENTRY}")


def test_every_router_module_imports_with_torch_and_the_shard_runtime_blocked() -> None:
    run_blocked("""
        import pkgutil
        import router
        names = [m.name for m in pkgutil.walk_packages(router.__path__, "router.")]
        assert len(names) > 30, names
        for name in names:
            importlib.import_module(name)
    """)


def run_blocked(code: str) -> None:
    """Run ``code`` in a fresh interpreter where importing torch, transformers or any
    shard module outside the contract (and the Ray entry) raises ImportError."""
    allowed = sorted(CONTRACT | {RAY_ENTRY})
    script = textwrap.dedent("""
        import importlib
        import importlib.abc
        import sys

        ALLOWED = set({allowed!r})
        HEAVY = ("torch", "transformers", "triton", "safetensors")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                top = name.split(".")[0]
                if top in HEAVY or (top == "shard" and name not in ALLOWED):
                    raise ImportError(f"{{name}} is blocked: not part of the contract")
                return None

        sys.meta_path.insert(0, Block())
    """).format(allowed=allowed) + textwrap.dedent(code) + textwrap.dedent("""
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
        assert not loaded, loaded
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
