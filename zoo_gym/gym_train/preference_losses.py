"""The ``loss_type`` values each preference stage accepts: TRL 1.16's, by trainer (imports nothing).

dpo: ``DPOConfig.loss_type`` (several joined by commas combine with equal weights, as TRL's list does);
kto: ``KTOConfig.loss_type``; simpo: CPO's ``"simpo"`` only; orpo has no loss_type.
"""

from __future__ import annotations

LOSS_TYPES = {
    "dpo": ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
            "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"),
    "kto": ("kto", "apo_zero_unpaired"),
    "orpo": (),
    "simpo": ("simpo",),
}


def loss_types(stage: str, loss_type: str | None) -> list[str] | None:
    """``loss_type`` as the list of names it holds (None: the trainer's default)."""
    if loss_type is None:
        return None
    return [t.strip() for t in str(loss_type).split(",")] if stage == "dpo" else [str(loss_type).strip()]


def loss_type_problem(stage: str, loss_type: str | None) -> str | None:
    """Why ``loss_type`` cannot train ``stage`` (completing "`loss_type` ..."), or None when it can."""
    names = loss_types(stage, loss_type)
    if names is None:
        return None
    allowed = LOSS_TYPES[stage]
    if not allowed:
        return f"must be unset for stage {stage!r} (it has one loss)"
    if any(n not in allowed for n in names):
        combine = " (several joined by commas combine)" if stage == "dpo" else ""
        return f"must be one of {', '.join(allowed)} for stage {stage!r}{combine}"
    return None
