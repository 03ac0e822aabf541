"""The house rules, checked on the source (issue 45): each layer imports only its own and the lower ones (kernels ->
comm -> optim -> hooks -> strategy -> callbacks); no import circle, type-only and function-level imports included; no
private name of one module used by another; no module over :data:`MOST_LINES` lines and few under
:data:`FEWEST_LINES`; no class that re-declares attributes another class sets (a mixin sharing its host's ``self``);
lines of at most 120 characters. Each rule's checker is tested on a made-up source too, so that it can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Optional

from tests.paths import ROOT

LAYERS = ("kernels", "comm", "optim", "hooks", "strategy", "callbacks")
PACKAGE = ROOT / "lightning_onebit"
#: No library module is longer than this (a module that needs more holds two things).
MOST_LINES = 450
#: A module shorter than this is a room too small to live in: at most :data:`SMALL_MODULES` of them (a package's
#: ``__init__`` aside).
FEWEST_LINES, SMALL_MODULES = 50, 3
MAX_LINE = 120


def _modules() -> tuple[dict[str, ast.Module], set[str]]:
    modules, packages = {}, set()
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
            packages.add(name)
        modules[name] = ast.parse(path.read_text())
    return modules, packages


def _imports(tree: ast.Module, module: str = "", package: bool = False) -> Iterator[tuple[str, Optional[str]]]:
    """Every import of the library in ``tree``: module-level, in ``if TYPE_CHECKING:`` blocks (annotations only) and
    inside functions alike, as ``(module, name)`` (``name`` ``None`` for ``import x``); relative imports resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = module.split(".") if package else module.split(".")[:-1]
                source = ".".join(parts[: len(parts) - node.level + 1] + ([source] if source else []))
            if source.startswith("lightning_onebit"):
                yield from ((source, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names if alias.name.startswith("lightning_onebit"))


def _graph(modules: dict[str, ast.Module], packages: set[str]) -> dict[str, set[str]]:
    """Module -> the leaf modules it imports (a name taken from a package followed to its source)."""

    def origin(module: str, name: Optional[str], seen: frozenset = frozenset()) -> str:
        if name and f"{module}.{name}" in modules:
            return f"{module}.{name}"
        if module in packages and name and (module, name) not in seen:
            for source, imported in _imports(modules[module], module, True):
                if imported == name:
                    return origin(source, name, seen | {(module, name)})
        return module

    leaves = {m for m in modules if m not in packages}
    return {m: {t for t in (origin(*i) for i in _imports(modules[m], m)) if t in leaves and t != m} for m in leaves}


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


def _private_uses(modules: dict[str, ast.Module], packages: set[str]) -> list[tuple[str, str]]:
    """``(module, name)`` for every private name (``_x``, not ``__x__``) one module takes from another: imported
    (``from lightning_onebit.a import _x``) or read from an imported library module (``a._x`` after ``import
    lightning_onebit.a as a`` or ``from lightning_onebit import a``)."""
    found = []
    for module, tree in modules.items():
        aliases = set()
        for source, name in _imports(tree, module, module in packages):
            if name is None:
                continue
            if name.startswith("_") and not name.startswith("__"):
                found.append((module, f"{source}.{name}"))
            elif f"{source}.{name}" in modules:  # a module imported by name
                aliases.add(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names if a.asname and a.name.startswith("lightning_onebit"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append((module, f"{node.value.id}.{node.attr}"))
    return found


def _shared_self(modules: dict[str, ast.Module]) -> list[tuple[str, str, list[str]]]:
    """Classes that declare attributes (``x: T`` with no value, in the class body) that they never set: attributes of
    a host class they are mixed into. Dataclasses, named tuples, enums and protocols declare fields that way and are
    left out."""
    found = []
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b) for b in node.bases}
            decorators = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
            if "dataclass" in decorators or bases & {"NamedTuple", "Protocol", "typing.NamedTuple", "enum.Enum",
                                                    "enum.StrEnum", "enum.IntEnum", "TypedDict"}:
                continue
            declared = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and s.value is None
                        and isinstance(s.target, ast.Name)]
            # set on the instance in the class's own code (``self.x = ...``, or ``instance.x = ...`` in ``__new__``)
            assigned = {t.attr for f in ast.walk(node) if isinstance(f, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                        for t in (f.targets if isinstance(f, ast.Assign) else [f.target])
                        for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)}
            foreign = [name for name in declared if name not in assigned]
            if foreign:
                found.append((module, node.name, foreign))
    return found


def _source(code: str, name: str = "lightning_onebit.x") -> tuple[dict[str, ast.Module], set[str]]:
    return {name: ast.parse(code)}, set()


# ------------------------------------------------------------------------------------------------------- the rules
def test_no_import_cycles_type_only_and_function_level_imports_included() -> None:
    modules, packages = _modules()
    graph = _graph(modules, packages)
    assert len(graph) > 40  # the walk found the library
    assert _cycles(graph) == []


def test_each_layer_imports_only_its_own_and_lower_layers() -> None:
    modules, packages = _modules()
    upward = [(m, t) for m, targets in _graph(modules, packages).items() for t in targets
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert upward == []


def test_no_private_name_crosses_a_module() -> None:
    assert _private_uses(*_modules()) == []


def test_no_module_over_the_most_lines_and_few_small_ones() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 40
    assert {path: n for path, n in sizes.items() if n > MOST_LINES} == {}
    small = {path: n for path, n in sizes.items() if n < FEWEST_LINES and not path.endswith("__init__.py")}
    assert len(small) <= SMALL_MODULES, small


def test_no_class_shares_its_host_classes_self() -> None:
    assert _shared_self(_modules()[0]) == []


def test_lines_are_at_most_120_characters() -> None:
    long = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert long == []


# ------------------------------------------------------------------------------ the checkers find what they look for
def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_type_only_and_function_level_imports_count() -> None:
    a = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_onebit.b import B\n")
    b = ast.parse("def f():\n    from lightning_onebit.a import A\n")
    graph = _graph({"lightning_onebit.a": a, "lightning_onebit.b": b}, set())
    assert _cycles(graph) == [["lightning_onebit.a", "lightning_onebit.b"]]


def test_the_private_name_finder_finds_imports_and_attributes() -> None:
    modules, packages = _source(
        "from lightning_onebit.comm.exchange import _all_gather, start_exchange_\n"
        "from lightning_onebit import kernels\n"
        "import lightning_onebit.optim.base as base\n"
        "x = kernels._uses_native_adam\ny = base._helper\nz = kernels.__name__\n"
    )
    modules.update({"lightning_onebit.kernels": ast.parse(""), "lightning_onebit.optim.base": ast.parse("")})
    assert sorted(_private_uses(modules, packages)) == [
        ("lightning_onebit.x", "base._helper"), ("lightning_onebit.x", "kernels._uses_native_adam"),
        ("lightning_onebit.x", "lightning_onebit.comm.exchange._all_gather"),
    ]


def test_the_shared_self_finder_finds_a_mixin() -> None:
    modules, _ = _source(
        "class Mixin:\n    param_groups: list\n    _step: int\n    def f(self):\n        return self._step\n"
        "class Owner:\n    step: int\n    def __init__(self):\n        self.step = 0\n"
        "@dataclasses.dataclass\nclass Fields:\n    x: int\n"
    )
    assert _shared_self(modules) == [("lightning_onebit.x", "Mixin", ["param_groups", "_step"])]


if __name__ == "__main__":  # the figures the rules above bound: python -m tests.test_layers
    found, packages = _modules()
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    small = sorted((n, p) for p, n in sizes.items() if n < FEWEST_LINES and not p.endswith("__init__.py"))
    print(f"{len(sizes)} modules, {sum(sizes.values())} lines; largest {max((n, p) for p, n in sizes.items())}; "
          f"under {FEWEST_LINES} lines: {small}")
    print(f"import circles (type-only and function-level imports included): {_cycles(_graph(found, packages))}")
    print(f"private names taken from another module: {_private_uses(found, packages)}")
    print(f"classes sharing a host's self: {_shared_self(found)}")
