"""A benchmark script (benchmarks/NAME.py) loaded as a module, for the tests that check what it computes.

By its path, since a script need not be an importable name (`async.py`), and under `module_name` in
sys.modules, where dataclasses resolve the annotations of the classes it defines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: str, module_name: str) -> ModuleType:
    """benchmarks/`script` executed as the module `module_name`."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
