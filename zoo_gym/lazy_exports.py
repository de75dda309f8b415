"""A package's public names imported from their submodules on first use (PEP 562).

``__getattr__, __dir__ = lazy_exports(__name__, globals(), {"submodule": "NameA NameB", ...})``: importing
the package (or a light submodule of it) then costs nothing until a name is used, so a command that
needs no torch (`gym-server status`) does not import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, namespace: dict, table: Mapping[str, str]) -> tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for ``package``: each name loads from its submodule once, then is cached."""
    where = {name: module for module, names in table.items() for name in names.split()}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
