"""A package's public names imported from their submodules on first use (PEP 562).

``__getattr__, __dir__ = lazy_exports(__name__, globals(), {"submodule": "NameA NameB", ...})``: importing
the package (or a light submodule of it) then costs nothing until a name is used, so a command that
needs no torch (`gym-server status`) does not import it. A name that is also its submodule's name
(`median` in `median.py`) stays the function: importing the submodule would otherwise bind the package
attribute to the module (the import system's `setattr(package, "median", module)`), and
`from zoo_gym.aggregation import median` would then return a module, depending on what was imported first.
A key may also be a whole module path (`"zoo_gym.evaluation.gradient"`): a name that moved to another package
stays importable from the one it was imported from before.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping


def lazy_exports(package: str, namespace: dict, table: Mapping[str, str]) -> tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for ``package``: each name loads from its submodule once, then is cached."""
    where = {name: module for module, names in table.items() for name in names.split()}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name]  # a submodule of `package`, or a module path of zoo_gym's (a name that moved)
        value = getattr(importlib.import_module(module if module.startswith("zoo_gym.") else f".{module}", package),
                        name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    shadowed = {name for name, module in where.items() if name == module}
    if shadowed:
        class _Package(types.ModuleType):
            def __setattr__(self, name: str, value) -> None:
                if name in shadowed and isinstance(value, types.ModuleType):
                    value = getattr(value, name)  # the submodule is fully executed when it is bound here
                super().__setattr__(name, value)

        sys.modules[package].__class__ = _Package
    return __getattr__, __dir__
