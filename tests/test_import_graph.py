"""The import graph of zoo_gym has no cycles, and no module imports another module's private names.

Every import counts, including those inside functions; only `if TYPE_CHECKING:` blocks are left out.
`from pkg import name` depends on `pkg.name` when that is a module, else on `pkg`; a package's
`__init__` is the module `pkg`. A cycle is a strongly connected component of more than one module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "zoo_gym"


def _module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_from(module: str, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for node in _imports(_parse(module)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve_from(module, node)
                if source is None:
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.append(full if full in MODULES else source)
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                dep = _nearest_module(target)
                if dep and dep != module:
                    graph[module].add(dep)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (recursive; the graph is a few hundred modules)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def private_imports() -> list[str]:
    """`from zoo_gym.a import _x` or `a._x` where `a` names another zoo_gym module."""
    offenders = []
    for module in MODULES:
        tree = _parse(module)
        where = MODULES[module].relative_to(ROOT)
        aliases: dict[str, str] = {}  # local name -> zoo_gym module it is bound to
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES:
                        aliases[alias.asname or alias.name] = alias.name
                continue
            source = _resolve_from(module, node)
            if source is None or source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif _private(alias.name) and source != module:
                    offenders.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            target = _attribute_module(node.value, aliases)
            if target and target != module:
                offenders.append(f"{where}:{node.lineno}: {target}.{node.attr}")
    return offenders


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _attribute_module(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    """The zoo_gym module that `expr` names (`name` or `pkg.sub.mod` built from an imported name)."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.Attribute):
        parent = _attribute_module(expr.value, aliases)
        if parent and f"{parent}.{expr.attr}" in MODULES:
            return f"{parent}.{expr.attr}"
    return None


def test_imports_inside_functions_count_and_type_checking_does_not():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden\n"
        "def f():\n    import inner\n"
        "class C:\n    def m(self):\n        from pkg import deep\n"
    )
    seen = {a.name for n in _imports(tree) for a in n.names}
    assert seen == {"TYPE_CHECKING", "inner", "deep"}


def test_tarjan_finds_the_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    components = sorted(strongly_connected_components(graph))
    assert components == [["a", "b", "c"], ["d"], ["e"]]


def test_the_graph_sees_the_package():
    graph = dependency_graph()
    assert "zoo_gym.codec" in MODULES and "zoo_gym.codec.api" in MODULES
    assert "zoo_gym.dashboard.charts" in graph["zoo_gym.dashboard.app"]


def test_no_import_cycles():
    cycles = [c for c in strongly_connected_components(dependency_graph()) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    offenders = private_imports()
    assert not offenders, "private names imported from another module:\n" + "\n".join(offenders)
