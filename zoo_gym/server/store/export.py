"""`gym-server export`: a published checkpoint as a plain Hugging Face directory with a model card.

The checkpoint tar is unpacked from the blob store (zoo_gym.proto.archive, which refuses anything but
flat plain files) and a README.md model card is written from the lineage of the chain genesis -> this
checkpoint (Checkpoint rows: manifest, held-out loss, time). The directory loads with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``; with ``fmt="gguf"`` it holds
one ``MODEL-QUANT.gguf`` for llama.cpp (zoo_gym.proto.gguf_export) and the card. Published directories
are readable by others (dirs 0755, files 0644) and name the base without the operator's paths.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from sqlmodel import select

from zoo_gym.proto import archive
from zoo_gym.proto.model_card import (make_readable, public_base_name, round_summary, weights_sha256,
                                      write_model_card)
from zoo_gym.server.store.models import Checkpoint
from zoo_gym.server.store.state import ServerState, StateError


def checkpoint_of_round(state: ServerState, round_id: int | None = None) -> Checkpoint:
    """The checkpoint published by `round_id` (0 = genesis; None = the latest published)."""
    with state.session() as s:
        q = select(Checkpoint)
        q = q.where(Checkpoint.round_id == round_id) if round_id is not None else q
        row = s.exec(q.order_by(Checkpoint.round_id.desc())).first()
    if row is None:
        raise StateError(f"round {round_id} has published no checkpoint; `gym-server status` lists those that exist"
                         if round_id is not None else "no checkpoint has been published")
    return row


def lineage(state: ServerState, ckpt: Checkpoint) -> list[Checkpoint]:
    """The chain genesis -> `ckpt` by parent sha256 (genesis first)."""
    chain, seen = [ckpt], {ckpt.sha256}
    with state.session() as s:
        while chain[-1].parent_sha256:
            parent = s.get(Checkpoint, chain[-1].parent_sha256)
            if parent is None or parent.sha256 in seen:
                break
            seen.add(parent.sha256)
            chain.append(parent)
    return chain[::-1]


def card_rows(chain: list[Checkpoint]) -> list[dict]:
    return [round_summary(json.loads(c.manifest_json or "{}"), sha256=c.sha256, heldout_loss=c.heldout_loss,
                          created_at=c.created_at.isoformat() if c.created_at else None) for c in chain]


def export_checkpoint(state: ServerState, out: Path, *, round_id: int | None = None, fmt: str = "hf",
                      quantization: str = "f16", license: str = "unknown") -> Checkpoint:
    """Unpack the checkpoint of `round_id` (default: the latest) into `out` (absent or empty) as a Hugging
    Face directory (`fmt` "hf") or a GGUF file (`fmt` "gguf", `quantization`) with a README.md model card;
    return its row."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StateError(f"{out} exists and is not an empty directory; export into a new one")
    ckpt = checkpoint_of_round(state, round_id)
    blob = state.blobs.path(ckpt.sha256)
    if not Path(blob).is_file():
        raise StateError(f"checkpoint {ckpt.sha256[:12]} (round {ckpt.round_id}) is no longer stored in "
                         f"{state.blobs.root} (swept by --keep-checkpoints, or removed); export a newer round")
    if fmt not in ("hf", "gguf"):
        raise StateError(f"--format must be hf, gguf or peft, got {fmt!r}")
    rows = card_rows(lineage(state, ckpt))
    if fmt == "hf":
        archive.unpack(blob, out)
        write_model_card(out, rows, base_model=state.base_model, license=license)
    else:
        from zoo_gym.proto.gguf_export import GGUFExportError, write_gguf_dir

        with tempfile.TemporaryDirectory(dir=out.parent if out.parent.is_dir() else None) as tmp:
            hf = archive.unpack(blob, Path(tmp) / "hf")
            try:
                write_gguf_dir(hf, out, rows, base_model=public_base_name(state.base_model, hf),
                               quantization=quantization, license=license, weights=weights_sha256(hf))
            except GGUFExportError as exc:
                raise StateError(str(exc)) from None
    make_readable(out)
    return ckpt

