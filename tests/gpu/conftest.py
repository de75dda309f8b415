"""The GPU suite (issue 32): every test here carries the `gpu` marker and is skipped, at collection and
without importing any CUDA-only package, where torch sees no CUDA device. CI has none: there the suite
costs its collection. On a GPU machine: ``scripts/gpu-check.sh`` (README, "GPU check"). Figures a test
measures go to the junit XML as properties (``record_property``), where gpu-check.sh reads them.
tests/e2e and tests/serving are put on the path for their helpers (e2e_processes.py, serving_helpers.py)."""

import sys
from pathlib import Path

import pytest
import torch

for _helpers in ("e2e", "serving"):
    sys.path.insert(0, str(Path(__file__).parents[1] / _helpers))

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False here); run scripts/gpu-check.sh on one"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
