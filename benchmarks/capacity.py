"""The capacity of one server box, on paper, from measured points (prints JSON; writes a plot or a text table).

Fits the server's measured rounds (benchmarks/results/scale-{0.6b,1.7b,4b}-2026-11-28.json, `POINTS`: scoring
off, 2 synthetic LoRA contributors) and the per-contributor costs measured by the other benchmarks
(aggregation.json: the default rule, trimmed mean, per contributor and parameter at n = 10 and 30; codec.json:
BitDelta decode per parameter; round.json: the server's upload rate with validation; one LoRA merge timed
here), then predicts, for Qwen3-shaped models from 0.6B to 72B and 10-10,000 contributors per round, with
rank-16 LoRA factors and with 1-bit full deltas: round time, peak RAM, disk and ingress (and download) bytes,
on this 2-core/24 GB box and on a 64-core/512 GB one. The model (which terms scale with the parameters,
which with the contributors) and every assumption are written into the JSON.

    python benchmarks/capacity.py [--results benchmarks/results] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

GB = 1e9
# Qwen3 dense shapes (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied); 72B: Qwen2.5-72B's
SHAPES = {
    "0.6B": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "1.7B": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "4B": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "8B": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "14B": (5120, 17408, 40, 40, 8, 128, 151936, False),
    "32B": (5120, 25600, 64, 64, 8, 128, 151936, False),
    "72B": (8192, 29568, 80, 64, 8, 128, 152064, False),
}
CONTRIBUTORS = (10, 30, 100, 300, 1000, 3000, 10000)
BOXES = {  # compute scales with cores from this box's 2; disk and NIC are assumptions, stated
    "2-core/24GB (this box)": {"cores": 2, "ram_bytes": 24 * 2**30, "disk_bytes": 250 * GB, "disk_speedup": 1.0,
                               "nic_bytes_per_s": 1.25e8},
    "64-core/512GB": {"cores": 64, "ram_bytes": 512 * 2**30, "disk_bytes": 8000 * GB, "disk_speedup": 2.0,
                      "nic_bytes_per_s": 1.25e9},
}
LORA_RANK = 16
LORA_BYTES_PER_ELEMENT = 2  # factors as the codec sends them (10,174,720 bytes for rank 8 at 0.6B: 2.02 B/element)
SORT_BYTES_PER_ELEMENT = 16  # trimmed mean: the stacked float32 row + sort's float32 values + int64 order
HOUR = 3600.0
# the server's measured rounds, one per size, all with the same code (benchmarks/scale.py --server-runs both)
POINTS = ("scale-0.6b-2026-11-28.json", "scale-1.7b-2026-11-28.json", "scale-4b-2026-11-28.json")


def counts(shape: tuple) -> dict:
    """Parameter counts of a Qwen3-shaped model: all, the decoder's Linear weights, the largest of each kind."""
    h, inter, layers, heads, kv, hd, vocab, tied = shape
    linears = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    p_lin = layers * sum(o * i for o, i in linears)
    norms = layers * (2 * h + 2 * hd) + h
    embed = vocab * h
    return {"params": p_lin + norms + embed * (1 if tied else 2), "linear_params": p_lin, "embedding": embed,
            "largest_linear": max(o * i for o, i in linears),
            "lora_r16_elements": layers * LORA_RANK * sum(o + i for o, i in linears)}


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def measured(results: Path) -> dict:
    """The measured points and per-unit costs this model is fitted on."""
    points = []
    for name in POINTS:
        path = results / name
        if not path.is_file():
            continue
        d = json.loads(path.read_text())
        run = d["runs"]["scoring_off"]
        shape = next(s for k, s in SHAPES.items() if k.lower() == d["size"])
        c = counts(shape)
        points.append({"file": name, "params": d["params"], "contributors": 2,
                       "aggregation_publish_s": run["aggregation_publish_s"], "vm_hwm_bytes": run["vm_hwm_bytes"],
                       "stacked_bytes": 2 * 4 * c["largest_linear"]})
    agg = json.loads((results / "aggregation.json").read_text())
    tm = [(v["n"], v["trimmed-mean"]["ours_s"] / (v["n"] * v["params"])) for v in agg.values()
          if isinstance(v, dict) and "trimmed-mean" in v and "ours_s" in v.get("trimmed-mean", {})]
    codec = json.loads((results / "codec.json").read_text())["matrix"]
    bd = codec["results"]["bitdelta_per_row"]
    rnd = json.loads((results / "round.json").read_text())["transfer"]
    return {"points": points, "trimmed_mean_s_per_contributor_param": tm,
            "bitdelta_decode_s_per_param": bd["decode_s"] / math.prod(codec["shape"]),
            "bitdelta_bits_per_param": bd["bits_per_param"],
            "upload_bytes_per_s": rnd["upload_MBps"] * 1e6, "lora_merge_s_per_param": lora_merge_s_per_param()}


def lora_merge_s_per_param(out: int = 9728, inp: int = 2560) -> float:
    """Seconds per merged element of one rank-16 B @ A on this box's 2 threads (best of 5)."""
    torch.set_num_threads(2)
    a, b = torch.randn(LORA_RANK, inp), torch.randn(out, LORA_RANK)
    dst = torch.empty(out, inp)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.matmul(b, a, out=dst)
        best = min(best, time.perf_counter() - t0)
    return best / (out * inp)


def fit(m: dict) -> dict:
    """Coefficients: the publish and the server's RAM per parameter (scale-*.json), the rule per contributor."""
    pts = m["points"]
    # through the origin: a free intercept went negative (-47 s) once the slow 4B point was in; per point below
    pub_b = sum(p["params"] * p["aggregation_publish_s"] for p in pts) / sum(p["params"] ** 2 for p in pts)
    pub_a = 0.0
    ram_a, ram_b = _fit_line([p["params"] for p in pts], [p["vm_hwm_bytes"] - p["stacked_bytes"] for p in pts])
    (n1, c1), (n2, c2) = sorted(m["trimmed_mean_s_per_contributor_param"])[:2]
    beta = (c2 - c1) / (math.log2(n2) - math.log2(n1))
    return {"publish_s": {"a": pub_a, "b_per_param": pub_b,
                          "per_point_s_per_param": {p["file"]: p["aggregation_publish_s"] / p["params"] for p in pts}},
            "server_ram_bytes": {"a": ram_a, "b_per_param": ram_b},
            "trimmed_mean_s_per_contributor_param": {"alpha": c1 - beta * math.log2(n1), "beta_per_log2_n": beta},
            "fitted_on": [p["file"] for p in pts]}


def predict(co: dict, m: dict, size: str, n: int, kind: str, box: dict) -> dict:
    c = counts(SHAPES[size])
    p = c["params"]
    speed = box["cores"] / 2
    if kind == "lora-r16":
        changed, largest = c["linear_params"], c["largest_linear"]
        payload = c["lora_r16_elements"] * LORA_BYTES_PER_ELEMENT
        decode = m["lora_merge_s_per_param"] * changed
    else:  # 1-bit full deltas: every tensor, the embedding (and untied output layer) the largest
        changed, largest = p, c["embedding"]
        payload = p * m["bitdelta_bits_per_param"] / 8
        decode = m["bitdelta_decode_s_per_param"] * changed
    tm = co["trimmed_mean_s_per_contributor_param"]
    rule = max(tm["alpha"] + tm["beta_per_log2_n"] * math.log2(n), 1e-12) * changed
    ingress = n * payload
    terms = {
        "ingest_s": max(ingress / (m["upload_bytes_per_s"] * speed), ingress / box["nic_bytes_per_s"]),
        "decode_s": n * decode / speed,
        "aggregate_s": n * rule / speed,
        "publish_s": (co["publish_s"]["a"] + co["publish_s"]["b_per_param"] * p) / box["disk_speedup"],
    }
    ram = co["server_ram_bytes"]["a"] + co["server_ram_bytes"]["b_per_param"] * p + n * SORT_BYTES_PER_ELEMENT * largest
    disk = 2 * (2 * p) + 2 * changed + ingress  # --keep-checkpoints 1: genesis + current bf16, master low half, uploads
    round_s = sum(terms.values())
    why = [w for w, bad in (("round > 1 h", round_s > HOUR), ("RAM", ram > box["ram_bytes"]),
                            ("disk", disk > box["disk_bytes"])) if bad]
    return {"size": size, "params": p, "contributors": n, "delta": kind, "round_s": round_s, "terms_s": terms,
            "peak_ram_bytes": ram, "disk_bytes_keep_1": disk, "disk_growth_per_round_keep_all": 2 * p + ingress,
            "ingress_bytes": ingress, "payload_bytes": payload, "download_bytes": n * 2 * p,
            "download_s_at_nic": n * 2 * p / box["nic_bytes_per_s"], "publishes_within_hour": not why,
            "limited_by": why}


MODEL = {
    "round_s": "ingest_s + decode_s + aggregate_s + publish_s (synchronous round, scoring off, default rule "
               "trimmed mean)",
    "ingest_s": "contributors x payload / max(the server's measured upload rate (stream + sha256 + write + "
                "validation + fsync) x cores/2, NIC): scales with contributors x delta size",
    "decode_s": "contributors x changed params x (LoRA: one rank-16 merge per element, timed here; 1-bit: BitDelta "
                "decode per param, codec.json) / (cores/2): scales with contributors x params",
    "aggregate_s": "contributors x changed params x (alpha + beta log2 contributors), trimmed mean measured at "
                   "n = 10 and 30 (aggregation.json) / (cores/2): scales with contributors x params x log n",
    "publish_s": "b x params, least squares through the origin on the measured rounds' aggregation + publish "
                 "(load, aggregate 2 LoRA deltas, write, pack, commit) / disk speed-up: scales with params only; "
                 "the points disagree (fit.publish_s.per_point_s_per_param), the 4B one, the slowest per parameter, "
                 "weighs most",
    "peak_ram_bytes": "a + b x params fitted on the measured scoring-off VmHWM (less the 2 stacked rows) + "
                      "contributors x 16 bytes x the largest changed tensor (the stacked float32 rows and the "
                      "sort's values and int64 order, one tensor at a time): params, plus contributors x one tensor",
    "disk_bytes_keep_1": "genesis + current bf16 checkpoints (2 x 2 bytes x params) + the float32 master's low half "
                         "(2 bytes x changed params) + the open round's uploads: params, plus contributors x payload",
    "download_bytes": "every contributor downloads the new bf16 checkpoint each round: contributors x 2 x params",
    "scoring": "not modelled (off in the fitted runs): streamed evaluation and scoring add one forward + backward "
               "over the scoring set per round, independent of contributors, and the first-order scores one dot "
               "product per contributor and parameter",
    "boxes": "compute terms scale with cores / 2 (assumes the per-tensor work parallelises over rows); publish "
             "with the stated disk speed-up; uploads are bounded by the NIC too",
}


def limits(rows: list[dict]) -> dict:
    """Per box and delta kind: the largest contributors count per size that publishes within the hour and
    the first (smallest model, fewest contributors) point that does not, with why."""
    out: dict = {}
    for r in rows:
        key = out.setdefault(r["box"], {}).setdefault(r["delta"], {"max_contributors_within_hour": {},
                                                                   "first_failure": None})
        if r["publishes_within_hour"]:
            best = key["max_contributors_within_hour"].get(r["size"], 0)
            key["max_contributors_within_hour"][r["size"]] = max(best, r["contributors"])
        else:
            key["max_contributors_within_hour"].setdefault(r["size"], 0)
            if key["first_failure"] is None:
                key["first_failure"] = {k: r[k] for k in ("size", "contributors", "limited_by", "round_s")}
    return out


def headline(lim: dict) -> list[str]:
    """One sentence per box and delta kind: up to where one box publishes within the hour, and what stops it."""
    out = []
    for box, kinds in lim.items():
        for kind, v in kinds.items():
            ok = ", ".join(f"{n} at {s}" for s, n in v["max_contributors_within_hour"].items() if n)
            f = v["first_failure"]
            stop = (f"; first miss: {f['size']} with {f['contributors']} contributors ({', '.join(f['limited_by'])})"
                    if f else "")
            out.append(f"{box}, {kind}: publishes within an hour with up to {ok or 'none of the grid'}{stop}")
    return out


def text_table(lim: dict) -> str:
    sizes = list(SHAPES)
    lines = []
    for box, kinds in lim.items():
        for kind, v in kinds.items():
            cells = [str(v["max_contributors_within_hour"].get(s, 0) or "-") for s in sizes]
            lines.append(f"| {box} | {kind} | " + " | ".join(cells) + " |")
    head = "| box | delta | " + " | ".join(sizes) + " |\n|" + "---|" * (2 + len(sizes))
    return head + "\n" + "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, kind in zip(axes, ("lora-r16", "bitdelta-1bit-full")):
        for box, style in zip(BOXES, ("-", "--")):
            for i, size in enumerate(SHAPES):
                pts = [r for r in rows if r["box"] == box and r["delta"] == kind and r["size"] == size]
                ax.plot([r["contributors"] for r in pts], [r["round_s"] for r in pts], style, marker=".",
                        color=f"C{i}", label=f"{size} {box.split('/')[0]}")
        ax.axhline(HOUR, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="contributors per round", title=f"round time, {kind}")
    axes[0].set_ylabel("seconds (line: one hour; solid: 2-core/24GB, dashed: 64-core/512GB)")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="a PNG (matplotlib); without matplotlib a text table is printed")
    args = ap.parse_args()
    m = measured(args.results)
    if len(m["points"]) < 2:
        raise SystemExit(f"capacity.py: needs at least two of {', '.join(POINTS)} in the results directory")
    co = fit(m)
    rows = [{"box": box, **predict(co, m, size, n, kind, spec)} for box, spec in BOXES.items()
            for kind in ("lora-r16", "bitdelta-1bit-full") for size in SHAPES for n in CONTRIBUTORS]
    lim = limits(rows)
    res = {"model": MODEL, "boxes": BOXES, "shapes": {k: counts(v) for k, v in SHAPES.items()}, "measured": m,
           "fit": co, "limits": lim, "headline": headline(lim), "table_markdown": text_table(lim), "predictions": rows}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            print(res["table_markdown"])


if __name__ == "__main__":
    main()
