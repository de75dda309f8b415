"""Turning a trained model into a delta against its base (Hu et al., "LoRA", 2021; Liu et al., "DoRA", 2024;
Meng et al., "PiSSA", 2024).

Keys are the names in the base's ``model.safetensors``. ``sft``: dense ``fine - base`` per parameter.
LoRA: ``LoraFactors(A (r, in), B (out, r) with the scaling folded in)`` keyed by the base weight's name,
or the merged dense delta; PiSSA's delta is factors of rank 2r ``[B, -B0] @ [A; A0]``; DoRA's is always
the merged dense one. GPT-2 ``Conv1D`` factors are sent as ``LoraFactors(A=B.T, B=A.T)``, already in
the base's layout, so the codec and the server never need to know the layer kind.
Details: docs/design/training.md.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import torch


def base_parameter_names(base_dir: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the base checkpoint's safetensors files."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    files = sorted(pathlib.Path(base_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {base_dir}: is it a Hugging Face model directory?")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out


def base_name_of_module(peft_module_name: str) -> str:
    """'base_model.model.model.layers.0.mlp.up_proj' -> 'model.layers.0.mlp.up_proj.weight'."""
    name = peft_module_name
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name + ".weight"


def dense_delta_from_models(base_state: dict[str, torch.Tensor], fine_model, names) -> dict[str, torch.Tensor]:
    """fine - base (float32) for each name; the fine model's parameters are looked up by name."""
    fine = dict(fine_model.named_parameters())
    fine.update({k: v for k, v in fine_model.named_buffers()})
    out = {}
    for k in names:
        t = fine.get(k)
        if t is None and k == "lm_head.weight":  # tied output embedding, listed under the input's name
            emb = fine_model.get_input_embeddings() if hasattr(fine_model, "get_input_embeddings") else None
            t = emb.weight if emb is not None else fine.get("model.embed_tokens.weight")
        if t is None:
            raise KeyError(f"the trained model has no parameter {k!r} of the base checkpoint")
        out[k] = (t.detach().float().cpu() - base_state[k].float().cpu()).contiguous()
    return out


def lora_factors(peft_model, *, adapter: str = "default", initial: dict | None = None) -> dict:
    """LoraFactors for every adapted Linear of a PEFT model (scaling folded into B).

    ``initial``: for PiSSA/OLoRA-style inits, the {base name: (A0, B0*s)} captured before training;
    the delta then is the rank-2r concatenation.
    """
    try:
        from zoo_gym.codec import LoraFactors
    except ImportError:  # the codec package may not re-export it yet
        from zoo_gym.codec.lora import LoraFactors

    out = {}
    for name, module in peft_model.named_modules():
        if not (hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {})):
            continue
        A = module.lora_A[adapter].weight.detach().float().cpu()  # (r, in)
        B = module.lora_B[adapter].weight.detach().float().cpu() * float(module.scaling[adapter])  # (out, r)
        key = base_name_of_module(name)
        if initial is not None and key in initial:
            A0, B0s = initial[key]
            A = torch.cat([A, A0], dim=0)  # (2r, in)
            B = torch.cat([B, -B0s], dim=1)  # (out, 2r)
        if _fan_in_fan_out(module):  # Conv1D: the base stores (in, out); (B @ A).T == A.T @ B.T
            A, B = B.T, A.T  # (r, out), (in, r)
        out[key] = LoraFactors(A=A.contiguous(), B=B.contiguous())
    return out


def _fan_in_fan_out(module) -> bool:
    """True for a LoRA layer over a weight stored (in, out) (GPT-2's Conv1D)."""
    if getattr(module, "fan_in_fan_out", False):
        return True
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
    return type(base).__name__ == "Conv1D"


def capture_initial_factors(peft_model, *, adapter: str = "default") -> dict:
    """{base name: (A0, B0*s)} of the adapter as initialised (needed when the init is not B=0)."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {}):
            A0 = module.lora_A[adapter].weight.detach().float().cpu().clone()
            B0 = module.lora_B[adapter].weight.detach().float().cpu().clone() * float(module.scaling[adapter])
            out[base_name_of_module(name)] = (A0, B0)
    return out


def merged_lora_delta(peft_model, base_state: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """Dense delta of the merged adapter: merge_and_unload() minus the original base, for adapted weights."""
    merged = peft_model.merge_and_unload()
    full = dense_delta_from_models(base_state, merged, names)
    # keep only the weights that changed (the adapted Linears); the rest is exactly zero
    return {k: v for k, v in full.items() if bool(v.abs().max() > 0)}


def load_base_state(base_dir) -> tuple[list[str], "BaseWeights"]:
    """(parameter names, {name: tensor}) of the base checkpoint's safetensors files, read lazily."""
    return list(base_parameter_names(base_dir)), BaseWeights(base_dir)


class BaseWeights(Mapping[str, torch.Tensor]):
    """The base checkpoint's tensors by name, each read from its safetensors file when it is asked for.

    Loading them all up front held a second copy of the base (0.5x a float32 model in bf16) beside the
    model being trained, for the whole run: a plain LoRA run never reads them (its delta is the adapter's
    factors), and a full or merged delta reads one tensor at a time. Each read opens and closes the file,
    so the mapped pages do not stay in the process either.
    """

    def __init__(self, base_dir) -> None:
        from safetensors import safe_open

        self._file: dict[str, str] = {}
        for f in sorted(pathlib.Path(base_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                self._file.update(dict.fromkeys(h.keys(), str(f)))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def adapter_delta(peft_model, config, base_state: dict[str, torch.Tensor], names, *, initial=None) -> dict:
    """The delta a LoRA-family run sends: exact factors, or dense where factors cannot say it.

    * 4-bit (QLoRA): the adapter's factors. The base's NF4 rounding is not something the contributor
      learned, and merged packed NF4 weights cannot be subtracted from the base (DoRA on 4-bit is refused
      by TrainConfig); dense B @ A on request.
    * DoRA (its magnitude vector is not low-rank) or `merged_delta`: merged model minus base, dense.
    * otherwise: LoraFactors (scaling folded into B).
    """
    if config.quantization == "4bit":
        factors = lora_factors(peft_model, initial=initial)
        return {k: f.merged() for k, f in factors.items()} if config.merged_delta else factors
    if config.merged_delta or config.use_dora:
        return merged_lora_delta(peft_model, base_state, names)
    return lora_factors(peft_model, initial=initial)
