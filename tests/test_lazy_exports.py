"""The packages' lazy public names are the functions they document, whatever was imported before."""

from __future__ import annotations

import subprocess
import sys

SHADOWED = {"zoo_gym.aggregation": ("bulyan", "centered_clip", "geometric_median", "krum", "mean", "median", "packed_mean",
                                    "trimmed_mean")}


def test_a_name_shared_with_its_submodule_stays_the_function_after_the_submodule_is_imported():
    # zoo_gym.aggregation.rules imports the median, krum, ... submodules; the import system then bound the
    # package attribute to the module, and `from zoo_gym.aggregation import median` returned a module
    code = "\n".join([
        "import types, zoo_gym.aggregation.rules",
        *(f"from {pkg} import {name}\nassert not isinstance({name}, types.ModuleType), {name!r}\n"
          f"assert callable({name}), {name!r}" for pkg, names in SHADOWED.items() for name in names),
        "import torch",
        "from zoo_gym.aggregation import median",
        "assert median(torch.tensor([[1.0], [5.0], [2.0]])).aggregate.tolist() == [2.0]",
        "import zoo_gym.aggregation.median, sys",
        "assert isinstance(sys.modules['zoo_gym.aggregation.median'], types.ModuleType)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_package_table_names_every_shadowed_export():
    # if a new submodule exports its own name, SHADOWED (above) should list it, so the check covers it
    from zoo_gym.aggregation import _LAZY

    names = {name for module, names in _LAZY.items() for name in names.split() if name == module}
    assert names == set(SHADOWED["zoo_gym.aggregation"])


def test_names_that_moved_to_evaluation_stay_importable_from_rewards():
    # issue 49: the streaming engine moved from zoo_gym.rewards to zoo_gym.evaluation; the rewards table names
    # their new modules, so `from zoo_gym.rewards import BaseGradient` keeps working and gives the same object
    import zoo_gym.evaluation as evaluation
    import zoo_gym.rewards as rewards

    moved = [name for module, names in rewards._LAZY.items() if module.startswith("zoo_gym.evaluation.")
             for name in names.split()]
    assert {"BaseGradient", "base_gradient", "PackedScoringSet", "pack_shared_prefix"} <= set(moved)
    for name in moved:
        assert getattr(rewards, name) is getattr(evaluation, name), name
