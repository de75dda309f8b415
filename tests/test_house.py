"""House rules of zoo_gym (issue 27) that a reader meets first: short module docstrings, short functions.

A module docstring states the module's contract in at most MAX_DOCSTRING_LINES lines; design reasoning
lives under docs/design/. No function or method in the server, aggregation or serving packages spans
more than MAX_FUNCTION_LINES lines, counted from its `def` line to its last line, docstring included.
Generated protobuf modules (`*_pb2*.py`) are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zoo_gym"
MAX_DOCSTRING_LINES = 12
MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_PACKAGES = ("server", "aggregation", "serving")


def _sources(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*.py")) if "_pb2" not in p.name]


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def long_docstrings(paths: list[Path], limit: int = MAX_DOCSTRING_LINES) -> list[str]:
    """`path: N lines` for each module whose docstring is longer than `limit` lines."""
    offenders = []
    for path in paths:
        doc = ast.get_docstring(_parse(path))
        if doc and len(doc.splitlines()) > limit:
            offenders.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    return offenders


def function_spans(tree: ast.AST):
    """(name, first line, length) of every function and method, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (N lines)` for each function longer than `limit` lines."""
    offenders = []
    for path in paths:
        for name, line, length in function_spans(_parse(path)):
            if length > limit:
                offenders.append(f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)")
    return offenders


def test_the_measures_count_what_they_say():
    tree = ast.parse("def f():\n    '''doc'''\n    return 1\n\nclass C:\n    async def m(self):\n        pass\n")
    assert sorted(function_spans(tree)) == [("f", 1, 3), ("m", 6, 2)]


def test_the_scan_sees_the_package():
    paths = _sources(PACKAGE)
    assert PACKAGE / "server" / "store" / "migrations" / "versions" / "0000_f956b6f.py" in paths
    assert not [p for p in paths if "_pb2" in p.name]


def test_module_docstrings_are_short():
    offenders = long_docstrings(_sources(PACKAGE))
    assert not offenders, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (state the contract; move design reasoning "
        "to docs/design/):\n" + "\n".join(offenders)
    )


def test_server_aggregation_and_serving_functions_are_short():
    paths = [p for pkg in SHORT_FUNCTION_PACKAGES for p in _sources(PACKAGE / pkg)]
    offenders = long_functions(paths)
    assert not offenders, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(offenders)
    )
