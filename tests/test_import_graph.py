"""The import graph of zoo_gym: no cycles, no private names across modules, and every arrow one the layers allow.

Every import counts: inside functions, under `if TYPE_CHECKING:`, and the lazy exports of a package's `_LAZY`
table (zoo_gym/lazy_exports.py). `from pkg import name` depends on `pkg.name` when that is a module, else on
`pkg`; a package's `__init__` is the module `pkg`. A cycle is a strongly connected component of more than one
module. The layers and the arrows they allow are read from the table under "## The layers" in
docs/design/ARCHITECTURE.md, the one place they are written down: a module belongs to the layer whose path is
the longest that contains it, may import its own layer's modules and those of the layers its row names, and
every row may name only rows above it (the table lists them bottom first), so no arrow goes back up.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "zoo_gym"
ARCHITECTURE = ROOT / "docs" / "design" / "ARCHITECTURE.md"
LAYERS_HEADING = "## The layers"


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


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth (functions, classes, `if TYPE_CHECKING:` blocks)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


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


def _lazy_targets(module: str, tree: ast.Module):
    """(line, module) for each key of a package's `_LAZY = {...}` table: a submodule, or a whole module path."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    name = key.value if key.value.startswith(f"{PACKAGE}.") else f"{module}.{key.value}"
                    yield key.lineno, name


@dataclass(frozen=True)
class Edge:
    """`module` imports `target` at `line` of its file."""
    module: str
    target: str
    line: int

    def where(self) -> str:
        return f"{MODULES[self.module].relative_to(ROOT)}:{self.line}"


def import_edges() -> list[Edge]:
    """Every (module, zoo_gym module it imports, line), one per import site."""
    edges = []
    for module in MODULES:
        tree = _parse(module)
        sites: list[tuple[int, str]] = []
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                sites += [(node.lineno, alias.name) for alias in node.names]
                continue
            source = _resolve_from(module, node)
            if source is None:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                sites.append((node.lineno, full if full in MODULES else source))
        if _is_package(module):
            sites += list(_lazy_targets(module, tree))
        for line, target in sites:
            if target.split(".")[0] != PACKAGE:
                continue
            dep = _nearest_module(target)
            if dep and dep != module:
                edges.append(Edge(module, dep, line))
    return edges


def dependency_graph(edges: list[Edge] | None = None) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for edge in import_edges() if edges is None else edges:
        graph[edge.module].add(edge.target)
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


# ---- the layers (docs/design/ARCHITECTURE.md) ----


@dataclass(frozen=True)
class Layer:
    name: str
    paths: tuple[str, ...]  # relative to zoo_gym/: "io/" (a folder) or "demo.py" (a file)
    may_import: frozenset[str]


def parse_layers(text: str) -> list[Layer]:
    """The rows of the first table under LAYERS_HEADING: | layer | paths in backticks | owns | may import |."""
    lines = text.split(f"\n{LAYERS_HEADING}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append(line)
    layers = []
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise ValueError(f"a layers row needs 4 cells (layer | paths | owns | may import): {line!r}")
        names = [n.strip().strip("`") for n in cells[3].split(",")]
        layer = Layer(cells[0].strip("`* "), tuple(re.findall(r"`([^`]+)`", cells[1])),
                      frozenset(n for n in names if n not in ("", "—", "-")))
        if not layer.paths:
            raise ValueError(f"layer {layer.name!r} names no paths")
        layers.append(layer)
    return layers


def layer_of(module: str, layers: list[Layer]) -> Layer | None:
    """The layer whose path is the longest one containing `module`'s file (None: no layer holds it)."""
    rel = MODULES[module].relative_to(ROOT / PACKAGE).as_posix()
    best, length = None, -1
    for layer in layers:
        for path in layer.paths:
            if (rel.startswith(path) if path.endswith("/") else rel == path) and len(path) > length:
                best, length = layer, len(path)
    return best


def table_problems(layers: list[Layer]) -> list[str]:
    """Rows that name an unknown layer or one not above them (the table is written bottom first)."""
    problems, seen = [], set()
    known = {layer.name for layer in layers}
    for layer in layers:
        for name in sorted(layer.may_import - seen):
            why = "is not a layer" if name not in known else "is not above it in the table (an arrow back up)"
            problems.append(f"layer {layer.name!r} may import {name!r}, which {why}")
        seen.add(layer.name)
    return problems


def forbidden_edges(edges: list[Edge], layers: list[Layer]) -> list[str]:
    """`file:line: module -> target (layer a -> layer b)` for every import the layers do not allow."""
    out = []
    for edge in edges:
        a, b = layer_of(edge.module, layers), layer_of(edge.target, layers)
        if a is None or b is None:
            missing = edge.module if a is None else edge.target
            out.append(f"{edge.where()}: {edge.module} -> {edge.target} ({missing} is in no layer)")
        elif a is not b and b.name not in a.may_import:
            out.append(f"{edge.where()}: {edge.module} -> {edge.target} (layer {a.name} may not import {b.name})")
    return sorted(set(out))


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


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return parse_layers(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_imports_inside_functions_and_type_checking_count():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden\n"
        "def f():\n    import inner\n"
        "class C:\n    def m(self):\n        from pkg import deep\n"
    )
    seen = {a.name for n in _imports(tree) for a in n.names}
    assert seen == {"TYPE_CHECKING", "hidden", "inner", "deep"}


def test_tarjan_finds_the_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    components = sorted(strongly_connected_components(graph))
    assert components == [["a", "b", "c"], ["d"], ["e"]]


def test_the_graph_sees_the_package(edges):
    graph = dependency_graph(edges)
    assert "zoo_gym.codec" in MODULES and "zoo_gym.codec.api" in MODULES
    assert "zoo_gym.dashboard.charts" in graph["zoo_gym.dashboard.app"]
    assert "zoo_gym.rewards.verify" in graph["zoo_gym.rewards.ledger"]  # under TYPE_CHECKING (and in a function)
    assert "zoo_gym.evaluation.gradient" in graph["zoo_gym.rewards"]  # a lazy export of a name that moved


def test_no_import_cycles(edges):
    cycles = [c for c in strongly_connected_components(dependency_graph(edges)) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    offenders = private_imports()
    assert not offenders, "private names imported from another module:\n" + "\n".join(offenders)


def test_the_layers_table_is_read_and_points_only_down(layers):
    names = [layer.name for layer in layers]
    assert {"io", "evaluation", "rewards", "gym_train", "server.store", "server.rounds", "dashboard"} <= set(names)
    assert len(names) == len(set(names)), names
    problems = table_problems(layers)
    assert not problems, f"{ARCHITECTURE.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_every_module_is_in_a_layer(layers):
    homeless = [m for m in MODULES if layer_of(m, layers) is None]
    assert not homeless, f"modules in no layer of {ARCHITECTURE.relative_to(ROOT)}: {homeless}"


def test_every_import_goes_where_the_layers_allow(layers, edges):
    offenders = forbidden_edges(edges, layers)
    assert not offenders, (f"imports the layers of {ARCHITECTURE.relative_to(ROOT)} forbid (move the code, or "
                           "change the table if the design changed):\n" + "\n".join(offenders))


def test_the_check_names_a_forbidden_arrow_with_its_file_and_line(layers):
    # the store importing the rounds, as store/queries.py did before issue 49
    edge = Edge("zoo_gym.server.store.queries", "zoo_gym.server.rounds.settlement", 7)
    assert forbidden_edges([edge], layers) == [
        "zoo_gym/server/store/queries.py:7: zoo_gym.server.store.queries -> zoo_gym.server.rounds.settlement "
        "(layer server.store may not import server.rounds)"]
    assert table_problems([Layer("low", ("a/",), frozenset({"high"})), Layer("high", ("b/",), frozenset())]) == [
        "layer 'low' may import 'high', which is not above it in the table (an arrow back up)"]
