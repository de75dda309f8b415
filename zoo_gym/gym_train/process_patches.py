"""Liger's kernels come as patches to transformers' modeling module of the model's type, for the whole process
(`apply_liger_kernel_to_<type>` replaces its RMSNorm and MLP classes and its rotary function). A model built
in the same process after a Liger training then runs Triton kernels, on the CPU too: the GPU check found a
CPU model failing with "Pointer argument cannot be accessed from Triton" after one. `train` puts the module
back when a Liger training ends. Written here because liger-kernel offers no way to undo its patches.
"""

from __future__ import annotations

import contextlib
import importlib
import pathlib
from collections.abc import Iterator

_KEPT = ("__dict__", "__weakref__")  # class attributes Python manages itself


def modeling_module(base_dir: str | pathlib.Path):
    """transformers' modeling module of the checkpoint's model type (imported), or None when it has none."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(AutoConfig.from_pretrained(str(base_dir)).model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


@contextlib.contextmanager
def restored_modeling_module(base_dir: str | pathlib.Path) -> Iterator[None]:
    """Inside: anything may patch the checkpoint's modeling module; after: its names and the attributes of
    the classes it defines are what they were before (patched instances keep their patches)."""
    module = modeling_module(base_dir)
    if module is None:
        yield
        return
    names = dict(vars(module))
    classes = {k: dict(vars(v)) for k, v in names.items() if isinstance(v, type) and v.__module__ == module.__name__}
    try:
        yield
    finally:
        for k, v in names.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        for cname, attrs in classes.items():
            cls = names[cname]
            for k, v in attrs.items():
                if k not in _KEPT and cls.__dict__.get(k) is not v:
                    setattr(cls, k, v)
