import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # serving_helpers

# A FutureWarning/DeprecationWarning raised from zoo_gym's own code fails the serving tests (pyproject's
# filterwarnings hides them elsewhere). transformers' deprecated keyword arguments warn from torch's module
# call wrapper (the model's forward our code calls), so that module is an error too.
_ERRORS = ("error::DeprecationWarning:zoo_gym", "error::FutureWarning:zoo_gym",
           "error::FutureWarning:torch.nn.modules.module", "error::DeprecationWarning:torch.nn.modules.module")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            for f in _ERRORS:
                item.add_marker(pytest.mark.filterwarnings(f))


@pytest.fixture(scope="session")
def inproc(tmp_path_factory):
    """One in-process Service over a copy of the tiny model, with a variants directory (two variants)."""
    from serving_helpers import random_variant_payload
    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.serving.service import ServeOptions, Service
    from zoo_gym.serving.variant import write_variant

    root = tmp_path_factory.mktemp("inproc")
    base = root / "base"
    shutil.copytree(tiny_model_dir(), base)
    vdir = root / "variants"
    for s in (1, 2):
        write_variant(vdir / f"user{s}.zgd", random_variant_payload(base, seed=s, scale=0.004))
    service = Service(ServeOptions(base=str(base), variants=str(vdir), window_ms=150, max_tokens=64,
                                   base_name="tiny"))
    service.start()
    try:
        yield service
    finally:
        service.stop()
