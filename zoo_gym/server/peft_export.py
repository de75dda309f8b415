"""`gym-server export --format peft`: a round's update as a PEFT LoRA adapter, by truncated SVD.

The update of round N is its checkpoint minus the checkpoint it was applied to (its parent, round N-1's),
read tensor by tensor from the archive blobs (the float32 masters when both are stored). The weights of
the modules PEFT's ``all-linear`` targets (the trainer's default) are factored with torch.linalg.svd in
float32 (B = U_r S_r, A = V_r^T, lora_alpha = r: scaling 1); every other tensor the update changes is
reported as left out with its relative size. Rank: the smallest per tensor whose relative Frobenius
error is <= 1e-3, or the one asked for. The adapter names its base by sha256 (metadata, README.md).
Design: docs/design/serving.md ("A round's update as a PEFT adapter").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zoo_gym.proto import archive
from zoo_gym.io.safetensors_reader import SafetensorsReader
from zoo_gym.server.store.checkpoint_writer import master_path, master_sha256
from zoo_gym.server.store.master_weights import master_of
from zoo_gym.server.store.models import Checkpoint, Round, RoundState
from zoo_gym.server.store.state import ServerState, StateError

ERROR_TARGET = 1e-3  # the default rank keeps every tensor's relative Frobenius error at or below this


@dataclass
class RoundUpdate:
    """What `export_round_adapter` wrote and measured (``as_json`` is the CLI's output)."""

    round_id: int
    base_round: int
    base_checkpoint: str
    base_weights: str
    source: str  # "float32 masters" or "published weights"
    tensors: dict = field(default_factory=dict)  # weight name -> {shape, rank, relative_error}
    left_out: dict = field(default_factory=dict)  # weight name -> {shape, relative_size}

    def as_json(self, out: Path) -> dict:
        errors = [t["relative_error"] for t in self.tensors.values()]
        return {"round": self.round_id, "adapter": str(out), "update_source": self.source,
                "base": {"round": self.base_round, "checkpoint_sha256": self.base_checkpoint,
                         "weights_sha256": self.base_weights},
                "max_relative_error": max(errors, default=0.0), "tensors": self.tensors, "left_out": self.left_out}


def update_checkpoints(state: ServerState, round_id: int | None) -> tuple[Checkpoint, Checkpoint]:
    """(round `round_id`'s checkpoint, the one it was applied to), both stored; StateError (one line) else."""
    with state.session() as s:
        if round_id is None:
            rnd = s.exec(_latest_published()).first()
            if rnd is None:
                raise StateError("no round has published a checkpoint yet; round 0 is the base, which has no update")
        else:
            rnd = s.get(Round, round_id)
        if round_id == 0:
            raise StateError("round 0 is the base: it has no update to export as an adapter (export it with "
                             "--format hf)")
        if rnd is None:
            raise StateError(f"round {round_id} does not exist; `gym-server status` lists the rounds")
        if rnd.state != RoundState.PUBLISHED or rnd.published_sha256 is None:
            raise StateError(f"round {rnd.id} is {rnd.state.value}: it has published no checkpoint yet; export "
                             "a published round")
        ckpt = s.get(Checkpoint, rnd.published_sha256)
        parent = s.get(Checkpoint, ckpt.parent_sha256) if ckpt is not None and ckpt.parent_sha256 else None
    if ckpt is None or not state.blobs.exists(ckpt.sha256):
        raise StateError(f"the checkpoint round {rnd.id} published ({rnd.published_sha256[:12]}) is no longer "
                         "stored; its update cannot be exported")
    if parent is None or not state.blobs.exists(parent.sha256):
        raise StateError(f"the checkpoint round {rnd.id} was applied to ({(ckpt.parent_sha256 or '?')[:12]}) is no "
                         f"longer stored (swept); round {rnd.id}'s update cannot be computed without it")
    return ckpt, parent


def _latest_published():
    from sqlmodel import select

    return select(Round).where(Round.state == RoundState.PUBLISHED).order_by(Round.id.desc())


def lora_targets(config: dict, names) -> set[str]:
    """The weight names (of `names`) of the modules PEFT's "all-linear" adapts: every Linear / Conv1D but the
    output layer (a tied one is not stored). A Conv1D's (in, out) update has the same SVD, transposed."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    cfg = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    output = model.get_output_embeddings()
    return {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not output and f"{n}.weight" in names}


def factor(delta: torch.Tensor, rank: int | None):
    """(LoraFactors with B @ A ~ delta, the relative Frobenius error of B @ A) by truncated SVD in float32;
    `rank` None: the smallest keeping the error <= ERROR_TARGET. Both bounded by min(delta.shape)."""
    from zoo_gym.codec import LoraFactors

    d = delta.float()
    norm = torch.linalg.norm(d)
    U, S, Vh = torch.linalg.svd(d, full_matrices=False)
    if rank is None:  # error after keeping k values: sqrt(sum of the squares of the rest) / norm
        rest = S.square().flip(0).cumsum(0).flip(0).sqrt()  # rest[k]: what keeping k leaves out
        small = (rest <= ERROR_TARGET * norm).nonzero()
        rank = max(1, int(small[0])) if small.numel() else S.numel()
    r = max(1, min(rank, S.numel()))
    B, A = U[:, :r] * S[:r], Vh[:r].contiguous()
    return LoraFactors(A=A, B=B.contiguous()), float(torch.linalg.norm(d - B @ A) / norm)


def _relative(delta: torch.Tensor, before: torch.Tensor) -> float | None:
    ref = float(torch.linalg.norm(before.float()))
    return float(torch.linalg.norm(delta.float())) / ref if ref > 0 else None


def _open(state: ServerState, ckpt: Checkpoint, use_masters: bool):
    weights = SafetensorsReader.in_archive(state.blobs.path(ckpt.sha256))
    master = master_path(state, ckpt.sha256) if use_masters else None
    return weights, (SafetensorsReader(master) if master is not None else None)


def compute_update(state: ServerState, ckpt: Checkpoint, parent: Checkpoint, rank: int | None, targets: set,
                   report: RoundUpdate) -> dict:
    """{weight name: LoraFactors} of the update parent -> ckpt; fills `report` (errors, left out)."""
    named = [c for c in (ckpt, parent) if master_sha256(c.manifest_json)]
    use_masters = all(master_path(state, c.sha256) is not None for c in named)
    report.source = "float32 masters" if use_masters and named else "published weights"
    (new, new_m), (old, old_m) = _open(state, ckpt, use_masters), _open(state, parent, use_masters)
    factors = {}
    try:
        if new.shapes() != old.shapes():
            raise StateError(f"round {report.round_id}'s checkpoint has other tensors than its parent's; "
                             "it has no update in LoRA form")
        for name, shape in new.shapes().items():
            if not new.infos[name].torch_dtype.is_floating_point:
                continue
            before = master_of(old.read(name), old_m, name)
            delta = master_of(new.read(name), new_m, name) - before
            if not bool(delta.any()):
                continue
            if name in targets:
                f, err = factor(delta, rank)
                factors[name] = f
                report.tensors[name] = {"shape": list(shape), "rank": int(f.A.shape[0]), "relative_error": err}
            else:
                report.left_out[name] = {"shape": list(shape), "relative_size": _relative(delta, before)}
    finally:
        for r in (new, new_m, old, old_m):
            if r is not None:
                r.close()
    return factors


def export_round_adapter(state: ServerState, out: Path, *, round_id: int | None = None,
                         rank: int | None = None) -> RoundUpdate:
    """Write round `round_id`'s update (default: the latest published round's) into `out` (absent or empty)
    as a PEFT LoRA adapter with a README.md; return what was measured."""
    from zoo_gym.proto.model_card import make_readable, public_base_name
    from zoo_gym.serving.peft_adapter import write_peft_adapter

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StateError(f"{out} exists and is not an empty directory; export into a new one")
    if rank is not None and rank < 1:
        raise StateError(f"--rank must be at least 1, got {rank}")
    ckpt, parent = update_checkpoints(state, round_id)
    blob = state.blobs.path(parent.sha256)
    spans = archive.members(blob)
    config = json.loads(archive.read_member(blob, spans["config.json"]))
    report = RoundUpdate(round_id=ckpt.round_id, base_round=parent.round_id, base_checkpoint=parent.sha256,
                         base_weights=_member_sha256(blob, spans[archive.WEIGHTS]), source="")
    with SafetensorsReader.in_archive(blob, spans) as r:
        targets = lora_targets(config, set(r.names()))
    factors = compute_update(state, ckpt, parent, rank, targets, report)
    if not factors:
        raise StateError(f"round {ckpt.round_id} changed none of the weights a LoRA adapts; nothing to export")
    base_name = f"{public_base_name(state.base_model)}-zoo-gym-round-{parent.round_id}"
    write_peft_adapter(factors, out, base_dir=None, base_sha256=report.base_weights, base_name=base_name,
                       base_config=config, metadata={"zoo_gym_round": str(ckpt.round_id),
                                                     "zoo_gym_base_checkpoint_sha256": parent.sha256})
    (out / "README.md").write_text(adapter_card(report, base_name))
    make_readable(out)
    return report


def _member_sha256(path: Path, span: tuple[int, int]) -> str:
    """sha256 of an archive member's bytes: for the weights, what gym-serve names an export of it by."""
    import hashlib

    h, (offset, size) = hashlib.sha256(), span
    with open(path, "rb") as f:
        f.seek(offset)
        while size > 0:
            chunk = f.read(min(size, 8 << 20))
            if not chunk:
                raise StateError(f"{path}: short read")
            h.update(chunk)
            size -= len(chunk)
    return h.hexdigest()


def adapter_card(report: RoundUpdate, base_name: str) -> str:
    """README.md of the adapter: which checkpoint it applies to, its ranks and errors, what it leaves out."""
    from huggingface_hub import ModelCardData

    doc = report.as_json(Path("."))
    doc.pop("adapter")
    data = ModelCardData(library_name="peft", pipeline_tag="text-generation", tags=["zoo-gym", "lora", "peft"],
                         zoo_gym=json.loads(json.dumps(doc)))
    lines = ["---", data.to_yaml(), "---", "", f"# Zoo Gym round {report.round_id}'s update as a LoRA adapter", "",
             f"Apply it to round {report.base_round}'s checkpoint `{report.base_checkpoint[:12]}` (weights "
             f"`{report.base_weights[:12]}`), nothing else: `gym-server export --round {report.base_round} BASE`, "
             "then `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), THIS_DIR)` gives round "
             f"{report.round_id}'s checkpoint up to the errors below. The round's update is dense (robust "
             f"aggregation, privacy noise); this is its truncated SVD ({report.source}, float32).", "",
             "| tensor | shape | rank | relative error |", "|---|---|---:|---:|"]
    lines += [f"| `{n}` | {t['shape']} | {t['rank']} | {t['relative_error']:.2e} |" for n, t in report.tensors.items()]
    if report.left_out:
        lines += ["", "Left out (a LoRA cannot carry them): the update's size relative to the tensor's.", "",
                  "| tensor | shape | relative size |", "|---|---|---:|"]
        lines += [f"| `{n}` | {t['shape']} | {_fmt(t['relative_size'])} |" for n, t in report.left_out.items()]
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) and math.isfinite(x) else "-"
