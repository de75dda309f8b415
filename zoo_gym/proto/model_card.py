"""The README.md model card of an exported or pulled checkpoint, computed from lineage manifests.

Pure functions over JSON (no database, no torch), so `gym-server export` and `gym-client pull` write the
same card: ``round_summary(manifest, sha256=..., heldout_loss=...)`` turns one lineage manifest (a
Checkpoint row's ``manifest_json`` or a checkpoint's ``zoo_gym_checkpoint.json``) into one row;
``model_card(rows, base_model=...)`` renders a Hugging Face metadata header (``base_model``,
``library_name: transformers``, ``tags``) and a body with the base model, the lineage (parent sha256,
rounds, contributors, aggregator) and each round's privacy spent and held-out loss;
``write_model_card(model_dir, rows, base_model=...)`` and ``write_model_card_from_dir(model_dir)`` (from
the checkpoint's manifest and its ``history``) write ``model_dir/README.md``. A missing key shows as "-".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zoo_gym.proto.archive import LINEAGE

CARD = "README.md"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def round_summary(manifest: dict, *, sha256: str | None = None, heldout_loss: float | None = None,
                  created_at: str | None = None) -> dict:
    """One lineage manifest as a card row: round, sha256, parent, contributors, accepted, methods,
    aggregator, epsilon (round, total), held-out loss, time. Explicit arguments win over the manifest."""
    privacy = manifest.get("privacy") or {}
    contributors = manifest.get("contributors")
    accepted = manifest.get("accepted")
    methods = sorted({str(s.get("method")) for s in manifest.get("submissions") or () if s.get("method")})
    loss = heldout_loss if heldout_loss is not None else manifest.get("heldout_loss")
    return {
        "round": manifest.get("round"),
        "sha256": sha256 or manifest.get("sha256"),
        "parent_sha256": manifest.get("parent_sha256"),
        "contributors": contributors if isinstance(contributors, list) else [],
        "n_contributors": len(contributors) if isinstance(contributors, list) else None,
        "n_accepted": len(accepted) if isinstance(accepted, list) else None,
        "methods": methods,
        "aggregator": manifest.get("aggregator"),
        "epsilon_round": privacy.get("epsilon_round"),
        "epsilon_total": privacy.get("epsilon_total"),
        "dp_delta": privacy.get("delta"),
        "dp_sample_rate": privacy.get("q"),  # the rate people were sampled at (1: everyone)
        "epsilon_total_rdp": privacy.get("epsilon_total_rdp"),  # the RDP cross-check of epsilon_total (PRV)
        "heldout_loss": loss,
        "created_at": created_at or manifest.get("published_at") or manifest.get("created_at"),
    }


def _hub_name(base_model: str) -> str:
    """A Hugging Face id as given; a local path or the built-in 'tiny' by its last component."""
    return base_model if _HUB_ID.match(base_model) and not Path(base_model).exists() else Path(base_model).name


def _num(x, fmt: str = "{:.4f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _sha(x) -> str:
    return f"`{x[:12]}`" if isinstance(x, str) and x else "-"


def model_card(rows: list[dict], *, base_model: str, title: str | None = None) -> str:
    """README.md text for the checkpoint of the last of `rows` (rows ordered genesis first)."""
    if not rows:
        raise ValueError("`rows` must hold at least the checkpoint's own round")
    rows = sorted(rows, key=lambda r: (r.get("round") is None, r.get("round") or 0))
    last = rows[-1]
    trained = [r for r in rows if (r.get("round") or 0) > 0]
    everyone = {c for r in trained for c in r.get("contributors") or ()}
    methods = sorted({m for r in trained for m in r.get("methods") or ()})
    eps = [r["epsilon_total"] for r in trained if isinstance(r.get("epsilon_total"), (int, float))]
    tags = ["zoo-gym", "federated-learning"] + methods + (["differential-privacy"] if eps else [])
    head = ["---", f"base_model: {json.dumps(_hub_name(base_model))}", "library_name: transformers", "tags:"]
    head += [f"- {json.dumps(t)}" for t in dict.fromkeys(tags)]
    head.append("---")
    title = title or f"{_hub_name(base_model)}, Zoo Gym round {last.get('round')}"
    n_contrib = len(everyone) if everyone else sum(r.get("n_contributors") or 0 for r in trained)
    body = [
        "",
        f"# {title}",
        "",
        f"A federated fine-tune of `{base_model}` by Zoo Gym contributors: each round "
        "merged the contributors' signed weight deltas with a robust aggregator and published the next "
        "checkpoint. It loads with `AutoModelForCausalLM.from_pretrained`; the prompt format is the chat "
        "template in its tokenizer files.",
        "",
        "## Lineage",
        "",
        f"* base model: `{base_model}`",
        f"* this checkpoint: round {last.get('round')}, sha256 {_sha(last.get('sha256'))}, parent "
        f"{_sha(last.get('parent_sha256'))}",
        f"* rounds: {len(trained)}; contributors: {n_contrib}"
        + (f"; methods: {', '.join(methods)}" if methods else ""),
        f"* aggregator: {', '.join(sorted({str(r['aggregator']) for r in trained if r.get('aggregator')})) or '-'}",
        f"* differential privacy: ε = {_num(max(eps), '{:.3f}')} spent in total"
        + (f" at δ = {last.get('dp_delta')}" if last.get("dp_delta") is not None else "") if eps else
        "* differential privacy: none",
        "",
        "| round | checkpoint | parent | contributors | accepted | aggregator | ε round | ε total | held-out loss |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        body.append(
            f"| {r.get('round')} | {_sha(r.get('sha256'))} | {_sha(r.get('parent_sha256'))} "
            f"| {r.get('n_contributors') if r.get('n_contributors') is not None else '-'} "
            f"| {r.get('n_accepted') if r.get('n_accepted') is not None else '-'} | {r.get('aggregator') or '-'} "
            f"| {_num(r.get('epsilon_round'), '{:.3f}')} | {_num(r.get('epsilon_total'), '{:.3f}')} "
            f"| {_num(r.get('heldout_loss'))} |")
    body += ["", "Round 0 is the base model. The held-out loss is the server's validation loss (mean "
             "completion-token cross-entropy) of each round's checkpoint.", ""]
    return "\n".join(head + body)


def write_model_card(model_dir, rows: list[dict], *, base_model: str, title: str | None = None) -> Path:
    """Write `model_card(rows, ...)` to `model_dir/README.md`; return its path."""
    path = Path(model_dir) / CARD
    path.write_text(model_card(rows, base_model=base_model, title=title))
    return path


def write_model_card_from_dir(model_dir, *, sha256: str | None = None) -> Path:
    """The card of a checkpoint directory from its own lineage manifest (and the manifest's `history`:
    earlier rounds' manifests or summaries, genesis first, when the server wrote one)."""
    manifest = json.loads((Path(model_dir) / LINEAGE).read_text())
    rows = [round_summary(m) for m in manifest.get("history") or ()]
    rows.append(round_summary(manifest, sha256=sha256))
    return write_model_card(model_dir, rows, base_model=str(manifest.get("base_model") or "unknown"))
