"""Benchmark: where central DP's loss of utility comes from, on one round (no Flower, no ray).

    python benchmarks/privacy_diagnosis.py --out benchmarks/results/privacy_diagnosis.json

One round of the privacy_utility protocol at N = 1000, q = 0.03 (Poisson, seed 0): each sampled contributor
trains 2 LoRA steps (batch 4, lr 1e-2) from the tiny base and sends its BitDelta payload; DeltaSoup (trimmed
mean) merges them (a) without DP, (b) clipped at C with z ~ 0 (clip only: z = 1e-9, the DP path's fixed
denominator and clipping without noise), (c) with noise z. Also the base plus Gaussian noise alone (no
training) at the per-coordinate std of (c): what the noise by itself does to this base's held-out loss.
Prints the contributors' delta norms, then held-out loss and token accuracy of each, as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch

    from privacy_utility import loss_and_accuracy
    from zoo_gym.aggregation import SoupConfig
    from zoo_gym.integrations.flower.apps import TRAIN_DEFAULTS, local_payload, tiny_arrays
    from zoo_gym.aggregation.soup import DeltaSoup
    from zoo_gym.aggregation.sources import DictDeltaSource
    from zoo_gym.codec import decode
    from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--q", type=float, default=0.03)
    ap.add_argument("--clips", default="0.3,2.3", help="clip norms C for (b) and (c) (comma-separated)")
    ap.add_argument("--z", default="0.5,1", help="noise multipliers for (c), at the largest C")
    ap.add_argument("--val", type=int, default=64)
    ap.add_argument("--cache-dir", default="", help="training cache (privacy_utility's format)")
    ap.add_argument("--out", default="benchmarks/results/privacy_diagnosis.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = random.Random(0)
    cohort = [p for p in range(args.n) if rng.random() < args.q]
    settings = {**TRAIN_DEFAULTS, "steps": 2, "batch-size": 4, "learning-rate": 1e-2, "cache-dir": args.cache_dir}
    decoded = [decode(local_payload(tiny_arrays(), partition=p, partitions=args.n, server_round=1, settings=settings))
               for p in cohort]
    shapes = {k: tuple(v.shape) for k, v in decoded[0].items()}
    deltas = [{k: v.float().reshape(-1) for k, v in d.items()} for d in decoded]
    norms = sorted(sum(float(v.pow(2).sum()) for v in d.values()) ** 0.5 for d in deltas)
    examples = default_validation_examples(args.val)
    ev = Evaluator(tiny_model_dir(), examples)
    m = round(args.q * args.n)

    def merged(config: SoupConfig) -> dict:
        out: dict = {}
        report = DeltaSoup(config).run(DictDeltaSource([str(p) for p in cohort], deltas), out.__setitem__,
                                       generator=torch.Generator().manual_seed(1), population=args.n)
        loss, acc, _ = loss_and_accuracy(ev, examples, {k: out[k].reshape(shapes[k]) for k in out})
        return {"loss": loss, "accuracy": acc, "noise_std": float(report.noise_std)}

    base_loss, base_acc, _ = loss_and_accuracy(ev, examples, {})
    rows = [{"run": "base", "loss": base_loss, "accuracy": base_acc}, {"run": "non-private", **merged(SoupConfig())}]
    clips, zs = [float(c) for c in args.clips.split(",")], [float(z) for z in args.z.split(",")]
    for c in clips:
        rows.append({"run": "clip only", "clip": c, **merged(SoupConfig(  # DP runs the fixed-m mean (issue 46)
            aggregator="mean", dp_noise_multiplier=1e-9, dp_clip=c, dp_expected_contributors=m))})
    for z in zs:
        row = {"run": "dp", "clip": clips[-1], "z": z, **merged(SoupConfig(
            aggregator="mean", dp_noise_multiplier=z, dp_clip=clips[-1], dp_expected_contributors=m))}
        g = torch.Generator().manual_seed(2)
        noise = {k: torch.normal(0.0, row["noise_std"], s, generator=g) for k, s in shapes.items()}
        row["noise_only_loss"], row["noise_only_accuracy"], _ = loss_and_accuracy(ev, examples, noise)
        rows.append(row)
    report = {"protocol": __doc__.split("\n\n", 2)[2].strip(), "args": vars(args), "cohort": len(cohort),
              "norms": {"min": norms[0], "median": norms[len(norms) // 2], "max": norms[-1]}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
