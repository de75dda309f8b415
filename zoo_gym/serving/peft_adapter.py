"""PEFT LoRA adapters in and out: ``adapter_config.json`` + ``adapter_model.safetensors`` directories.

Out: a variant file keeps only 1-bit signs and group scales, so the LoRA factors are written when they
exist, at training time (``gym-client personalize --peft-out DIR``): ``write_peft_adapter(factors, ...)``
turns the trainer's ``LoraFactors`` (scaling folded into B; GPT-2 Conv1D ones in the base layout) into an
adapter that ``PeftModel.from_pretrained(base, DIR)`` loads with the trained model's outputs (scaling 1).
In: a directory holding ``adapter_config.json`` is a gym-serve variant; ``peft_variant`` merges each
module's ``B @ A * scaling`` into a dense delta and codes it as BitDelta (mean-|delta| group scales, as
``personalize --distill-steps 0``), so it serves through the same kernels. The adapter's safetensors
metadata ``zoo_gym_base_sha256`` (written here) makes gym-serve refuse it over other weights.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch

from zoo_gym.serving.variant import Variant, VariantError, VariantMismatch, encode_variant, variant_from_payload

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def is_peft_dir(path) -> bool:
    return pathlib.Path(path).is_dir() and (pathlib.Path(path) / CONFIG).is_file()


def write_peft_adapter(factors: dict, out, *, base_dir, base_sha256: str, base_name: str,
                       base_config: dict | None = None, metadata: dict | None = None) -> pathlib.Path:
    """`out`/adapter_config.json + adapter_model.safetensors from ``{base weight name: LoraFactors}``;
    `base_config`: the base's config.json (default: read from `base_dir`); `metadata`: more safetensors
    metadata (strings)."""
    from safetensors.torch import save_file

    cfg = base_config if base_config is not None else json.loads((pathlib.Path(base_dir) / "config.json").read_text())
    conv1d = cfg.get("model_type") == "gpt2"  # factors arrive as (A=B.T, B=A.T) in the (in, out) layout
    tensors, ranks = {}, {}
    for name, f in sorted(factors.items()):
        if not (hasattr(f, "A") and hasattr(f, "B")) or not name.endswith(".weight"):
            raise VariantError(f"{name}: not LoRA factors (a dense delta has no PEFT adapter form)")
        module = name.removesuffix(".weight")
        A, B = (f.B.T, f.A.T) if conv1d else (f.A, f.B)
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = A.float().contiguous()
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = B.float().contiguous()
        ranks[module] = int(A.shape[0])
    if not tensors:
        raise VariantError("no LoRA factors to write")
    r = max(ranks.values())
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "r": r,
              "lora_alpha": r, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": conv1d,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in ranks}), "use_rslora": False,
              "rank_pattern": {m: k for m, k in ranks.items() if k != r},
              "alpha_pattern": {m: k for m, k in ranks.items() if k != r}}  # alpha == rank: scaling 1
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={**(metadata or {}), "format": "pt",
                                                     "zoo_gym_base_sha256": base_sha256})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def peft_base_sha256(path) -> str | None:
    """The base weights sha256 an adapter was written for (None: a foreign adapter, shapes checked only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(pathlib.Path(path) / WEIGHTS), framework="pt") as st:
            return (st.metadata() or {}).get("zoo_gym_base_sha256")
    except Exception as exc:  # noqa: BLE001 - any unreadable adapter is one refusal line
        raise VariantError(f"not a PEFT adapter: {WEIGHTS}: {exc}") from None


def _scaling(config: dict, module: str, r: int) -> float:
    alpha = next((v for k, v in (config.get("alpha_pattern") or {}).items() if module.endswith(k)),
                 config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def peft_dense_delta(path) -> dict[str, torch.Tensor]:
    """``{base weight name: B @ A * scaling}`` in the base's layout (Conv1D (in, out) when fan_in_fan_out)."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("modules_to_save"):
        raise VariantError(f"{path.name}: gym-serve serves plain LoRA adapters (no DoRA, no modules_to_save)")
    weights = load_file(str(path / WEIGHTS))
    delta = {}
    for key, A in weights.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise VariantError(f"{path.name}: tensor {key!r} is not a LoRA factor")
            continue
        module = key.removesuffix(".lora_A.weight")
        B = weights.get(f"{module}.lora_B.weight")
        if B is None or A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise VariantError(f"{path.name}: {module}: malformed LoRA factors")
        module = module.removeprefix(_PREFIX)
        d = (B.float() @ A.float()) * _scaling(config, module, A.shape[0])
        delta[f"{module}.weight"] = d.T.contiguous() if config.get("fan_in_fan_out") else d
    if not delta:
        raise VariantError(f"{path.name}: no LoRA factors")
    return delta


def peft_variant(path, *, base_sha256: str, name: str, group_size: int = 128) -> Variant:
    """A PEFT directory as a served :class:`Variant` (BitDelta-coded merged delta, see module docstring)."""
    written_for = peft_base_sha256(path)
    if written_for is not None and written_for != base_sha256:
        raise VariantMismatch(f"variant {name!r} was built for base {written_for[:12]}, this server's base is "
                              f"{base_sha256[:12]}; refusing it")
    payload = encode_variant(peft_dense_delta(path), base_sha256=base_sha256, group_size=group_size,
                             info={"peft_adapter": pathlib.Path(path).name})
    return variant_from_payload(payload, name=name, base_sha256=base_sha256)
