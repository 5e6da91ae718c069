"""No two router modules import each other, directly or around a loop, at the top or
inside a function: each module's job then reads from its imports downwards, and none
works only because the other half of a loop was imported first."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def router_imports() -> dict[str, set[str]]:
    """Each router module (generated stubs aside) → the router modules it imports."""
    paths = [path for path in (REPO / "router").rglob("*.py") if "pb" not in path.parts]
    modules = {module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named.add(node.module)
                named.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {other for other in named if other in modules and other != name}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph``: its strongly connected components of more than
    one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_loop_finder_finds_a_loop() -> None:
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_router_modules_import_no_loop() -> None:
    graph = router_imports()
    assert "router.executors" in graph and "router.ray_placement" in graph
    assert loops(graph) == []
