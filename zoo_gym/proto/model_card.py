"""The README.md model card of an exported or pulled checkpoint, computed from lineage manifests.

Pure functions over JSON, so `gym-server export` and `gym-client pull` write the same card:
``round_summary(manifest, ...)`` turns one lineage manifest into a row; ``model_card(rows, base_model=...)``
renders huggingface_hub ``ModelCardData`` (``base_model`` only for a Hub id, ``license`` default "unknown":
a fine-tune inherits its base's, which the operator names; ``pipeline_tag``, tags, a model-index with the
held-out loss) and the lineage table. A base is named by :func:`public_base_name`, never by the operator's
path. The metadata's ``zoo_gym`` maps the checkpoint sha256 to the weights sha256 (:func:`base_label`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zoo_gym.proto.archive import LINEAGE

CARD = "README.md"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _privacy_line(eps: list[float], unbounded: list, last: dict) -> str:
    """The card's privacy line: the ε spent and what it covers, or why no guarantee is claimed."""
    if not eps:
        return "* differential privacy: none"
    if unbounded:
        return (f"* differential privacy: none claimed: round(s) {', '.join(map(str, unbounded))} added noise "
                "calibrated to the mean's influence but ran a rule whose influence it does not bound, so the ε "
                "those rounds reported is not a bound (docs/design/privacy.md)")
    delta = f" at δ = {last.get('dp_delta')}" if last.get("dp_delta") is not None else ""
    public = last.get("dp_participation") in (None, "public")
    return (f"* differential privacy: ε = {_num(max(eps), '{:.3f}')}{delta} spent in total, for the published "
            f"weights ({last.get('dp_mechanism') or 'mean'}; "
            + ("participation public, so it protects what a contributor's delta contains, not whether it took part; "
               if public else "participation private; ")
            + "per-contributor scores and pay are outside it and shown to their owner only)")


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
        "dp_mechanism": privacy.get("mechanism"),
        "dp_participation": privacy.get("participation"),
        # a bound only for a mechanism whose influence the noise covers: recorded since issue 46 (`mechanism`), or
        # an earlier release's mean (`covers_aggregator`); an earlier robust rule with the mean's noise: no bound
        "dp_bound": bool(privacy.get("mechanism") or privacy.get("covers_aggregator")) if privacy else None,
        "heldout_loss": loss,
        "created_at": created_at or manifest.get("published_at") or manifest.get("created_at"),
    }


def hub_id(base_model: str, model_dir=None) -> str | None:
    """`base_model` when it is a Hugging Face id (not a local path), else the ``_name_or_path`` of
    ``model_dir/config.json`` when that is one; None when neither names a Hub model."""
    if _HUB_ID.match(base_model or "") and not Path(base_model).expanduser().exists():
        return base_model
    try:
        name = json.loads((Path(model_dir) / "config.json").read_text()).get("_name_or_path") if model_dir else None
    except (OSError, ValueError):
        name = None
    return name if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).exists() else None


def public_base_name(base_model: str, model_dir=None) -> str:
    """How a published artifact names a base: its Hub id, else 'tiny' or a local directory's last component."""
    return hub_id(base_model, model_dir) or Path(str(base_model)).name or "unknown"


def _card_data(rows: list[dict], *, title: str, base: str | None, license: str, tags: list[str], library: str,
               weights: str | None = None):
    from huggingface_hub import EvalResult, ModelCardData

    loss = rows[-1].get("heldout_loss")
    evals = [EvalResult(task_type="text-generation", dataset_type="held-out", dataset_name="server validation set",
                        metric_type="loss", metric_name="held-out loss", metric_value=float(loss))
             ] if isinstance(loss, (int, float)) else None
    return ModelCardData(base_model=base, license=license, library_name=library,
                         pipeline_tag="text-generation", tags=tags, model_name=title, eval_results=evals,
                         zoo_gym={"round": rows[-1].get("round"), "checkpoint_sha256": rows[-1].get("sha256"),
                                  "weights_sha256": weights})


def _num(x, fmt: str = "{:.4f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _sha(x) -> str:
    return f"`{x[:12]}`" if isinstance(x, str) and x else "-"


def model_card(rows: list[dict], *, base_model: str, title: str | None = None, license: str = "unknown",
               model_dir=None, gguf: str | None = None, weights: str | None = None) -> str:
    """README.md text for the checkpoint of the last of `rows` (rows ordered genesis first); `model_dir`
    (the checkpoint's files) lets a local base be named by its config's Hub id; `gguf`: the card of a
    GGUF export (that file's name)."""
    if not rows:
        raise ValueError("`rows` must hold at least the checkpoint's own round")
    rows = sorted(rows, key=lambda r: (r.get("round") is None, r.get("round") or 0))
    last = rows[-1]
    trained = [r for r in rows if (r.get("round") or 0) > 0]
    everyone = {c for r in trained for c in r.get("contributors") or ()}
    methods = sorted({m for r in trained for m in r.get("methods") or ()})
    eps = [r["epsilon_total"] for r in trained if isinstance(r.get("epsilon_total"), (int, float))]
    unbounded = [r.get("round") for r in trained if isinstance(r.get("epsilon_total"), (int, float))
                 and r.get("dp_bound") is False]
    tags = (["zoo-gym", "federated-learning", "bitdelta"] + (["gguf"] if gguf else []) + methods
            + (["differential-privacy"] if eps and not unbounded else []))
    hub, base_model = hub_id(base_model, model_dir), public_base_name(base_model, model_dir)
    title = title or f"{base_model}, Zoo Gym round {last.get('round')}"
    data = _card_data(rows, title=title, base=hub, license=license, tags=list(dict.fromkeys(tags)),
                      library="gguf" if gguf else "transformers", weights=weights)
    loads = (f"`{gguf}` runs with llama.cpp (`llama-cli -m {gguf}`) and Ollama (`FROM ./{gguf}`)" if gguf else
             "It loads with `AutoModelForCausalLM.from_pretrained`")
    head = ["---", data.to_yaml(), "---"]
    n_contrib = len(everyone) if everyone else sum(r.get("n_contributors") or 0 for r in trained)
    if trained and all(r.get("n_contributors") is None for r in trained):
        n_contrib = "not published (participation private)"
    body = [
        "",
        f"# {title}",
        "",
        f"A federated fine-tune of `{base_model}` by Zoo Gym contributors: each round "
        "merged the contributors' signed weight deltas with a robust aggregator and published the next "
        f"checkpoint. {loads}; the prompt format is the chat template in its tokenizer files.",
        "",
        "## Lineage",
        "",
        f"* base model: `{base_model}`",
        f"* this checkpoint: round {last.get('round')}, sha256 {_sha(last.get('sha256'))}, parent "
        f"{_sha(last.get('parent_sha256'))}" + (f" (weights {_sha(weights)}, the name gym-serve and "
                                                 "personalize print)" if weights else ""),
        f"* rounds: {len(trained)}; contributors: {n_contrib}"
        + (f"; methods: {', '.join(methods)}" if methods else ""),
        f"* aggregator: {', '.join(sorted({str(r['aggregator']) for r in trained if r.get('aggregator')})) or '-'}",
        _privacy_line(eps, unbounded, last),
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


def write_model_card(model_dir, rows: list[dict], *, base_model: str, title: str | None = None,
                     license: str = "unknown", gguf: str | None = None, weights: str | None = None) -> Path:
    """Write `model_card(rows, ...)` to `model_dir/README.md`; return its path. `weights`: the weights
    sha256 (default: computed from `model_dir`'s safetensors, when it has them)."""
    path = Path(model_dir) / CARD
    if weights is None and any(Path(model_dir).glob("*.safetensors")):
        weights = weights_sha256(model_dir)
    path.write_text(model_card(rows, base_model=base_model, title=title, license=license, model_dir=model_dir,
                               gguf=gguf, weights=weights))
    return path


def write_model_card_from_dir(model_dir, *, sha256: str | None = None, license: str = "unknown") -> Path:
    """The card of a checkpoint directory from its own lineage manifest (and the manifest's `history`:
    earlier rounds' manifests or summaries, genesis first, when the server wrote one)."""
    rows, base_model = card_inputs_from_dir(model_dir, sha256=sha256)
    return write_model_card(model_dir, rows, base_model=base_model, license=license)


def card_inputs_from_dir(model_dir, *, sha256: str | None = None) -> tuple[list[dict], str]:
    """(rows genesis first, public base name) from a checkpoint directory's lineage manifest."""
    manifest = json.loads((Path(model_dir) / LINEAGE).read_text())
    rows = [round_summary(m) for m in manifest.get("history") or ()]
    rows.append(round_summary(manifest, sha256=sha256))
    return rows, public_base_name(str(manifest.get("base_model") or "unknown"), model_dir)


def make_readable(root) -> None:
    """A published directory readable by others: directories 0755, files 0644."""
    root = Path(root)
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def weights_sha256(model_dir) -> str:
    """sha256 of the ``*.safetensors`` bytes in sorted name order: gym-serve's and personalize's base name."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def base_label(model_dir, weights: str | None = None) -> str:
    """"checkpoint X (weights Y)" when the directory's card maps them (an export or pull) or it is a
    checkpoint cache directory named by its sha256, else "weights Y" (`weights` None: the card's)."""
    try:
        from huggingface_hub import metadata_load

        meta = (metadata_load(Path(model_dir) / CARD) or {}).get("zoo_gym") or {}
    except Exception:  # noqa: BLE001 - no card, or not ours
        meta = {}
    weights = weights or meta.get("weights_sha256") or "?"
    ckpt = meta.get("checkpoint_sha256") if meta.get("weights_sha256") == weights else None
    name = Path(model_dir).name  # the caches of join/pull and the server: checkpoints/<sha256>/ with its lineage
    if ckpt is None and re.fullmatch(r"[0-9a-f]{64}", name) and (Path(model_dir) / LINEAGE).is_file():
        ckpt = name
    return f"checkpoint {ckpt[:12]} (weights {weights[:12]})" if isinstance(ckpt, str) else f"weights {weights[:12]}"
