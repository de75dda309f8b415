"""PNG heat-map table of `benchmarks/robustness.py`'s JSON: held-out loss ratios per aggregator x
attack, against the same aggregator's no-attack run (left) and the no-attack FedAvg run (right).

    python benchmarks/robustness_plot.py [benchmarks/results/robustness.json]
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _grid(doc: dict, key: str) -> tuple[list[str], list[str], list[list[float]]]:
    aggs = list(doc["results"])
    attacks = list(next(iter(doc["results"].values())))
    values = [[doc["results"][a][k].get(key, math.nan) for k in attacks] for a in aggs]
    return aggs, attacks, values


def plot(doc: dict, path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    tol = doc["protocol"]["config"]["tolerance"]
    panels = (("ratio_same_aggregator", "loss / same aggregator, no attack"),
              ("ratio_fedavg_clean", "loss / FedAvg, no attack"))
    aggs, attacks, _ = _grid(doc, panels[0][0])
    fig, axes = plt.subplots(2, 1, figsize=(2.5 + 0.95 * len(attacks), 2.2 + 0.9 * len(aggs)))
    for ax, (key, title) in zip(axes, panels):
        _, _, vals = _grid(doc, key)
        finite = [v for row in vals for v in row if math.isfinite(v)]
        hi = max([2.0, *finite])
        norm = TwoSlopeNorm(vmin=min([0.8, *finite]), vcenter=1.0 + tol, vmax=hi)
        shown = [[v if math.isfinite(v) else 1.0 for v in row] for row in vals]
        ax.imshow(shown, cmap="RdYlGn_r", norm=norm, aspect="auto")
        for i, row in enumerate(vals):
            for j, v in enumerate(row):
                text = "n/a" if not math.isfinite(v) else (f"{v:.2f}" if v < 100 else f"{v:.0f}")
                ax.text(j, i, text, ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(attacks)), [a.replace("_", "\n") for a in attacks], fontsize=8)
        ax.set_yticks(range(len(aggs)), aggs, fontsize=8)
        ax.set_title(title, fontsize=9)
    cfg = doc["protocol"]["config"]
    fig.suptitle(f"Held-out loss after R={cfg['rounds']} rounds, n={cfg['n']}, f={cfg['f']} "
                 f"(tiny model; no-attack FedAvg {doc['no_attack_fedavg_loss']}, base "
                 f"{doc['base_loss']}; green <= {1 + tol:.2f})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    src = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "robustness.json"
    print(plot(json.loads(src.read_text()), src.with_suffix(".png")))
