"""Benchmark: is a refactor's speed within noise? Old and new code run the same benchmarks, alternating.

    python benchmarks/old_new.py --old 3957ef7 [--runs 2] [--out benchmarks/results/old_new.json]
    python benchmarks/old_new.py --old 3957ef7 --only init --init-runs 3 --out FILE   # `gym-server init` at 0.6B
    python benchmarks/old_new.py --summarize DIR     # the runs already in DIR (agg-old-1.json, scale-new-2.json ...)

Each run is `benchmarks/aggregation.py --quick` then `benchmarks/scale.py --size 0.6b`, old, new, old, new ...
(old from a `git worktree` of --old, each side with its own benchmark script and its own `zoo_gym` on PYTHONPATH).
For every timed figure the summary gives old's and new's medians over the runs, their ratio new/old, and the
noise: the larger of the two sides' own spread (max/min over its runs). A ratio inside [1/noise, noise] is
"within noise"; above it, "worse beyond noise" (the target: none). Memory peaks (VmHWM) are compared the same way.
Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGG_CASES = ("tiny_n10", "synthetic4M_n10", "dense2M_n10")


def _agg_figures(doc: dict) -> dict[str, float]:
    """Our own best-call seconds per case and rule (Flower's sides are not the code under test)."""
    out = {}
    for case in AGG_CASES:
        for rule, r in doc.get(case, {}).items():
            if isinstance(r, dict) and "ours_s" in r:
                out[f"aggregation/{case}/{rule}/ours_s"] = r["ours_s"]
    return out


def _init_figures(doc: dict) -> dict[str, float]:
    return {"init-0.6b/init_s": doc["init_s"]}


def _scale_figures(doc: dict) -> dict[str, float]:
    out = {}
    for run in ("scoring_off", "scoring_on"):
        r = doc["runs"].get(run, {})
        for key in ("aggregation_publish_s", "evaluation_s", "scoring_s", "vm_hwm_bytes", "init_peak_rss_bytes"):
            if isinstance(r.get(key), (int, float)):
                out[f"scale-0.6b/{run}/{key}"] = r[key]
        if isinstance(r.get("phases", {}).get("init"), dict):
            out[f"scale-0.6b/{run}/init_s"] = r["phases"]["init"]["seconds"]
    return out


def summarize(runs: Path) -> dict:
    sides: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for side in sides:
        for path in sorted(runs.glob(f"*-{side}-*.json")):
            doc = json.loads(path.read_text())
            kind = path.name.split("-")[0]
            figs = {"agg": _agg_figures, "scale": _scale_figures, "init": _init_figures}[kind](doc)
            for k, v in figs.items():
                sides[side].setdefault(k, []).append(float(v))
    rows = {}
    for key in sorted(set(sides["old"]) & set(sides["new"])):
        old, new = sides["old"][key], sides["new"][key]
        noise = max(max(x) / min(x) if min(x) > 0 else float("inf") for x in (old, new))
        ratio = statistics.median(new) / statistics.median(old)
        rows[key] = {"old": old, "new": new, "ratio_new_over_old": round(ratio, 3), "noise": round(noise, 3),
                     "within_noise": 1 / noise <= ratio <= noise, "not_worse_beyond_noise": ratio <= noise}
    timed = [r for k, r in rows.items() if not k.endswith("_bytes")]
    worse = sorted(k for k, r in rows.items() if not r["not_worse_beyond_noise"])
    return {"figures": rows, "runs_per_side": min((len(v) for v in sides["old"].values()), default=0),
            "targets": {"figures": len(rows), "within_noise": sum(r["within_noise"] for r in rows.values()),
                        "worse_beyond_noise": worse,
                        "timed_median_ratio": round(statistics.median(r["ratio_new_over_old"] for r in timed), 3)
                        if timed else None}}


def time_init(work: Path, old_tree: Path, runs: int) -> None:
    """`gym-server init` of one 0.6B-shaped base (benchmarks/scale.py's), old and new alternating."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.scale import build_model

    base = work / "base-0.6b"
    build_model("0.6b", base)
    for i in range(1, runs + 1):
        for side, tree in (("old", old_tree), ("new", ROOT)):
            state = work / f"state-{side}"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zoo_gym.server", "init", "--state-dir", str(state),
                            "--base-model", str(base)], cwd="/", env=env, check=True, capture_output=True)
            (work / f"init-{side}-{i}.json").write_text(json.dumps({"init_s": time.perf_counter() - t0}))
            shutil.rmtree(state)


def run(old_ref: str, runs: int, work: Path, only: str, init_runs: int) -> None:
    old_tree = work / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old_tree), old_ref], check=True)
    try:
        if only in ("all", "init"):
            time_init(work, old_tree, init_runs)
        benches = (("agg", ["benchmarks/aggregation.py", "--quick"]),
                   ("scale", ["benchmarks/scale.py", "--size", "0.6b"]))
        for bench, args in benches if only == "all" else ():
            for i in range(1, runs + 1):
                for side, tree in (("old", old_tree), ("new", ROOT)):
                    out = work / f"{bench}-{side}-{i}.json"
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    print(f"{bench} {side} {i}", file=sys.stderr, flush=True)
                    subprocess.run([sys.executable, *args, "--out", str(out)], cwd=tree, env=env, check=True,
                                   stdout=subprocess.DEVNULL)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="the git revision before the change")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", choices=("all", "init"), default="all", help="init: only `gym-server init` at 0.6B")
    ap.add_argument("--init-runs", type=int, default=3)
    ap.add_argument("--work", type=Path, help="keep the runs' JSON here (default: a temporary directory)")
    ap.add_argument("--summarize", type=Path, help="summarize the runs already in this directory")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "old_new.json")
    args = ap.parse_args()
    if args.summarize:
        doc = {"old": args.old, **summarize(args.summarize)}
    else:
        if not args.old:
            ap.error("--old REV is required (or --summarize DIR)")
        with tempfile.TemporaryDirectory() as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            run(args.old, args.runs, work, args.only, args.init_runs)
            doc = {"old": args.old, **summarize(work)}
    print(json.dumps(doc, indent=1))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
