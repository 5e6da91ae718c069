"""Triton's compiler lets a ``@triton.jit`` function read a module global only when it is
a ``tl.constexpr`` (its CPU interpreter, which the tests run, reads any): a plain number
there fails to compile on a GPU. Every global number our kernels read must be one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytest.importorskip("triton")

SHARD = Path(__file__).resolve().parents[2] / "shard"


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)]


def plain_number_globals(path: Path, module_name: str) -> list[str]:
    """``file: function: NAME`` for each module global that a jit function of ``path``
    (imported as ``module_name``) reads and that is a plain int, float or bool."""
    source = path.read_text()
    if "triton" not in source:
        return []
    module = importlib.import_module(module_name)
    found = []
    for fn in _jit_functions(ast.parse(source)):
        local = {a.arg for a in fn.args.args}
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and node.id not in local and isinstance(getattr(module, node.id, None),
                                                            int | float | bool):
                found.append(f"{path.name}: {fn.name}: {node.id}")
    return sorted(set(found))


def test_jit_functions_read_no_plain_number_global() -> None:
    paths = sorted(SHARD.rglob("*.py"))
    assert sum(bool(_jit_functions(ast.parse(p.read_text()))) for p in paths) >= 8
    offenders = [hit for p in paths for hit in plain_number_globals(
        p, ".".join(p.relative_to(SHARD.parent).with_suffix("").parts))]
    assert offenders == []


def test_the_check_finds_a_plain_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a kernel reading FP8_MAX = 448.0 (as the fp8 kernels once did) is found
    probe = tmp_path / "jit_globals_probe.py"
    probe.write_text("import triton\nimport triton.language as tl\nLIMIT = 448.0\n"
                     "OK = tl.constexpr(1.0)\n\n\n@triton.jit\ndef _k(x_ptr):\n"
                     "    tl.store(x_ptr, LIMIT + OK)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plain_number_globals(probe, "jit_globals_probe") == [
        "jit_globals_probe.py: _k: LIMIT"]
