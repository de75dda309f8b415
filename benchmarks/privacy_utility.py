"""Benchmark: privacy-utility curve at population scale, through the package's Flower apps in Flower's
simulation engine (ray). Held-out loss of the tiny model against epsilon (delta = 1e-6).

    python benchmarks/privacy_utility.py --quick     # N=100, z in {1, 4}, 2 rounds (~5-10 min on 2 busy cores)
    python benchmarks/privacy_utility.py             # N=100 and 1000, z in {0.5, 1, 2, 4} (~40-60 min, 2 idle cores)
    python benchmarks/privacy_utility.py --ray-address auto   # on a ray cluster (README: ray start --head / --address)

Protocol (also in the JSON under "protocol"): N virtual contributors (`flower_apps.client_app`), contributor
i owns shard i mod 100 of the built-in task (beyond 100, its own draws from that shard); each round every node is sampled with probability q (Poisson, the
same draws for every configuration of one N: seed 0); a sampled contributor trains `--steps` LoRA steps of
batch `--batch-size` (gym_train.train, merged dense delta) from the current global model and replies its
BitDelta payload. The server (`SampledSoupStrategy`) runs DeltaSoup with the default rule (trimmed mean,
trim_beta 0.1) and, for z > 0, central DP: whole-delta clip C, noise z C / m on the mean with m = q N the
expected cohort, q = m / N. The non-private run has no clip and no noise. Byzantine: the contributors
with the lowest 20% of partition ids send -4 x their own delta (boosted sign flip) whenever sampled.
epsilon: Poisson-sampled Gaussian rounds (z, q, rounds) by opacus' PRV accountant, RDP as a cross-check
(the project's accountant, RDP, also reported). gain_share = (L_base - L_run) / (L_base - L_nonprivate
clean run). Simplification: identical inputs (base sha256, partition, round, training settings) reuse one
training (a disk cache): every configuration of one N shares round 1's; nothing else is approximated.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

DELTA = 1e-6


def epsilons(z: float, q: float, rounds: int) -> dict:
    """(PRV, RDP) epsilon at DELTA of `rounds` Poisson-sampled Gaussian rounds, computed by opacus."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    out = {}
    for name, cls in (("prv", PRVAccountant), ("rdp", RDPAccountant)):
        acc = cls()
        acc.history = [(z, q, rounds)]
        out[name] = float(acc.get_epsilon(delta=DELTA))
    return out


def configurations(zs: list[float], byzantine: float) -> list[dict]:
    return [{"z": z, "byzantine": b} for b in (0.0, byzantine) for z in [0.0, *zs]]


def run_population(n: int, args, configs: list[dict]) -> list[dict]:
    """One simulation of n nodes; its ServerApp runs every configuration in turn."""
    import torch
    from flwr.app import ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from zoo_gym.aggregation import SoupConfig
    from zoo_gym.aggregation.flower_apps import (TRAIN_DEFAULTS, SampledSoupStrategy, client_app,
                                                 heldout_evaluate_fn, tiny_arrays)
    from zoo_gym.gym_train import default_validation_examples

    q = args.cohort / n
    cache = tempfile.mkdtemp(prefix="zoo-gym-pu-cache-")
    rows: list[dict] = []
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for cfg in configs:
            t0 = time.perf_counter()
            dp = dict(dp_noise_multiplier=cfg["z"], dp_clip=args.clip, dp_expected_contributors=args.cohort,
                      dp_delta=DELTA) if cfg["z"] > 0 else {}
            strategy = SampledSoupStrategy(SoupConfig(**dp), sample_rate=q, seed=0, population=n,
                                           generator=torch.Generator().manual_seed(1))
            losses: list[float] = []
            train = {**TRAIN_DEFAULTS, "steps": args.steps, "batch-size": args.batch_size,
                     "learning-rate": args.lr, "byzantine-fraction": cfg["byzantine"], "cache-dir": cache}
            strategy.start(grid=grid, initial_arrays=tiny_arrays(), num_rounds=args.rounds,
                           train_config=ConfigRecord(train),
                           evaluate_fn=heldout_evaluate_fn(default_validation_examples(args.val), losses))
            row = {"n": n, "q": q, **cfg, "losses": losses, "final_loss": losses[-1], "cohorts": strategy.cohorts,
                   "accepted": [r.n_accepted for r in strategy.reports],
                   "noise_std": [float(r.noise_std) for r in strategy.reports],
                   "refused_rounds": strategy.refused_rounds, "seconds": time.perf_counter() - t0}
            if cfg["z"] > 0:
                row["epsilon"] = epsilons(cfg["z"], q, len(strategy.reports))
                row["epsilon"]["project_rdp"] = strategy.accountant.epsilon(delta=DELTA)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("n", "z", "byzantine", "final_loss", "seconds")}), flush=True)

    init = {"address": args.ray_address} if args.ray_address else {"num_cpus": args.cpus}
    run_simulation(server_app=app, client_app=client_app(), num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {**init, "include_dashboard": False}})
    return rows


def targets(rows: list[dict], *, n: int, z: float) -> dict:
    """epsilon, gain_share and gain_share_byzantine at (n, z) against the non-private clean run."""
    pick = {(r["z"], r["byzantine"] > 0): r for r in rows if r["n"] == n}
    base = rows[0]["losses"][0]
    clean = pick.get((0.0, False))
    gain = base - clean["final_loss"] if clean else float("nan")
    private, byz = pick.get((z, False)), pick.get((z, True))
    out = {"n": n, "z": z, "delta": DELTA, "base_loss": base, "nonprivate_loss": clean and clean["final_loss"],
           "epsilon": private["epsilon"]["prv"] if private else None,
           "gain_share": (base - private["final_loss"]) / gain if private else None,
           "gain_share_byzantine": (base - byz["final_loss"]) / gain if byz else None}
    out["met"] = bool(out["epsilon"] is not None and out["epsilon"] <= 8 and (out["gain_share"] or 0) >= 0.8
                      and (out["gain_share_byzantine"] or 0) >= 0.7)
    return out


def chosen_z(rows: list[dict], *, n: int, max_epsilon: float = 8.0) -> float:
    """The smallest z of population n whose epsilon (PRV) is <= max_epsilon (else the largest z)."""
    private = sorted({r["z"]: r["epsilon"]["prv"] for r in rows if r["n"] == n and r["z"] > 0}.items())
    within = [z for z, eps in private if eps <= max_epsilon]
    return within[0] if within else private[-1][0]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r["n"] for r in rows}):
        for byz, style in ((0.0, "-o"), (None, "--s")):
            sel = [r for r in rows if r["n"] == n and (r["byzantine"] == 0) == (byz == 0.0)]
            priv = sorted((r for r in sel if r["z"] > 0), key=lambda r: r["epsilon"]["prv"])
            label = f"N={n}" + ("" if byz == 0.0 else ", 20% Byzantine")
            line = ax.plot([r["epsilon"]["prv"] for r in priv], [r["final_loss"] for r in priv], style, label=label)
            for r in sel:
                if r["z"] == 0:
                    ax.axhline(r["final_loss"], color=line[0].get_color(), ls=":", lw=1)
    ax.axhline(rows[0]["losses"][0], color="grey", lw=1, label="base model")
    ax.set_xscale("log")
    ax.set_xlabel(f"epsilon (PRV, delta={DELTA:g})")
    ax.set_ylabel("held-out loss (dotted: non-private)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N=100, z in {1, 4}, 2 rounds, cohort 10")
    ap.add_argument("--n", default="100,1000", help="populations (comma-separated)")
    ap.add_argument("--z", default="0.5,1,2,4", help="noise multipliers (comma-separated); 0 = non-private is always run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cohort", type=int, default=30, help="expected contributors per round m; q = m / N")
    ap.add_argument("--steps", type=int, default=2, help="LoRA steps per contributor round")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--clip", type=float, default=0.3, help="whole-delta L2 clip C (honest 2-step deltas: ~0.35)")
    ap.add_argument("--byzantine", type=float, default=0.2)
    ap.add_argument("--target-z", type=float, help="z of the `targets` entry (largest N); default: the "
                    "smallest z whose epsilon is <= 8 (chosen from epsilon alone, not from the losses)")
    ap.add_argument("--val", type=int, default=64, help="held-out examples")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="ray CPUs (one contributor each)")
    ap.add_argument("--ray-address", help="connect to a running ray cluster (e.g. auto) instead of a local one")
    ap.add_argument("--out", default="benchmarks/results/privacy_utility.json")
    args = ap.parse_args()
    if args.quick:
        args.n, args.z, args.rounds, args.cohort = "100", "1,4", 2, 10
    ns, zs = [int(x) for x in args.n.split(",")], [float(x) for x in args.z.split(",")]
    t0 = time.perf_counter()
    rows = [row for n in ns for row in run_population(n, args, configurations(zs, args.byzantine))]
    report = {"protocol": __doc__.split("\n\n", 2)[2].strip(), "args": vars(args), "rows": rows,
              "wall_s": time.perf_counter() - t0, "cpu_count": os.cpu_count(),
              "targets": targets(rows, n=max(ns), z=args.target_z if args.target_z is not None
                                 else chosen_z(rows, n=max(ns)))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(json.dumps(report["targets"], indent=1))


if __name__ == "__main__":
    main()
