"""The house rules, checked on the source: no import cycles between the library's modules, and each layer imports only
its own layer and the ones below (kernels -> comm -> optim -> hooks -> strategy -> callbacks)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Optional

from tests.paths import ROOT

LAYERS = ("kernels", "comm", "optim", "hooks", "strategy", "callbacks")
PACKAGE = ROOT / "lightning_onebit"


def _modules() -> tuple[dict[str, ast.Module], set[str]]:
    modules, packages = {}, set()
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
            packages.add(name)
        modules[name] = ast.parse(path.read_text())
    return modules, packages


def _imports(tree: ast.Module) -> Iterator[tuple[str, Optional[str]]]:
    """Module-level imports of the library, leaving out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_onebit"):
            yield from ((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names if alias.name.startswith("lightning_onebit"))


def _graph() -> dict[str, set[str]]:
    """Module -> the leaf modules it imports at import time (a name taken from a package followed to its source)."""
    modules, packages = _modules()

    def origin(module: str, name: Optional[str], seen: frozenset = frozenset()) -> str:
        if name and f"{module}.{name}" in modules:
            return f"{module}.{name}"
        if module in packages and name and (module, name) not in seen:
            for source, imported in _imports(modules[module]):
                if imported == name:
                    return origin(source, name, seen | {(module, name)})
        return module

    leaves = {m for m in modules if m not in packages}
    return {m: {t for t in (origin(*i) for i in _imports(modules[m])) if t in leaves and t != m} for m in leaves}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> Optional[int]:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_import_cycles() -> None:
    graph = _graph()
    assert len(graph) > 40  # the walk found the library
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_layer_imports_only_its_own_and_lower_layers() -> None:
    upward = [(m, t) for m, targets in _graph().items() for t in targets
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert upward == []
