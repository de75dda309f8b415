"""The first decoder layers of a checkpoint as a model directory of their own (`gym-server init`'s preflight).

``short_base(model_dir, dest, layers=k)`` writes ``dest``: the config with ``num_hidden_layers = k`` (and its
per-layer lists cut to k), the tokenizer files, and a ``model.safetensors`` holding the tensors outside the
decoder layers plus those of layers 0..k-1, in their stored dtype. It returns None, writing nothing, when the
checkpoint's layer tensors cannot be told apart (no ``layers.N.``/``h.N.``/``blocks.N.`` names covering
every layer) or the model has no more than k layers: the caller then checks the whole model.
Why: docs/design/SCALE-OUT.md ("init").
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

WEIGHTS = "model.safetensors"
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def short_base(model_dir: Path, dest: Path, *, layers: int) -> Path | None:
    """`dest` holding the first `layers` decoder layers of `model_dir` (see the module docstring), or None."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    model_dir, dest = Path(model_dir), Path(dest)
    cfg = AutoConfig.from_pretrained(str(model_dir))
    text = cfg.get_text_config()
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= layers:
        return None
    with safe_open(str(model_dir / WEIGHTS), framework="pt") as f:
        names = list(f.keys())
        if {_layer_of(k) for k in names} - {None} != set(range(n)):
            return None
        dest.mkdir(parents=True, exist_ok=True)
        kept = {k: f.get_tensor(k) for k in names if (_layer_of(k) is None or _layer_of(k) < layers)}
        save_file(kept, str(dest / WEIGHTS), metadata=f.metadata() or {"format": "pt"})
    del kept
    text.num_hidden_layers = layers
    for attr, value in list(vars(text).items()):  # per-layer lists (layer_types ...) must match the new depth
        if isinstance(value, list) and len(value) == n and attr != "architectures":
            setattr(text, attr, value[:layers])
    cfg.save_pretrained(str(dest))
    for p in model_dir.iterdir():
        if p.is_file() and p.name not in (WEIGHTS, "config.json") and not p.suffix == ".safetensors":
            shutil.copyfile(p, dest / p.name)
    return dest
