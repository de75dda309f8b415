"""Could rewards scored on the completion loss be gated by their standard error, as exact-match scoring is?

An offline check on the real base: the pay part's ten uploads of `benchmarks/learning.py --rounds 1 --parts pay`
(read from `--payloads DIR`, as `--pay-uploads` kept them, or trained again), each one's leave-one-out marginal
under the default rule on the server's completion loss over the first n scoring examples of its validation
questions (the server's default scoring set, and larger), with the marginal's standard error over those
examples: each example's summed token loss times n / (the n examples' tokens), so that their mean is the
token-weighted mean loss and the paired differences' std / sqrt(n) is the marginal's error. `z` is the marginal
over its error: exact-match scoring pays nothing at z <= 1 (`--scoring-min-marginal-z`). Beside each, the
recorded ground truth (results/learning.json, `pay.contributors[].loo_exact_match_gain`). Prints JSON.

    python benchmarks/learning_pay_loss_gate.py [--payloads DIR] [--ns N,N] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks import learning as L  # noqa: E402
from benchmarks.learning_pay_metric import uploads  # noqa: E402
from zoo_gym.server.config import RewardsSettings  # noqa: E402

SERVER_SCORING_EXAMPLES = RewardsSettings.__dataclass_fields__["scoring_examples"].default  # the server's default


def per_example_loss(model, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """(examples,) each example's summed completion-token cross-entropy, and its completion tokens (float64)."""
    sums, tokens = [], []
    with torch.no_grad():
        for ids, mask, labels in batches:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            target = labels[:, 1:]
            scored = target != -100
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
            sums.append((ce * scored).sum(1))
            tokens.append(scored.sum(1))
    return torch.cat(sums).double(), torch.cat(tokens).double()


def gated(without: torch.Tensor, full: torch.Tensor, tokens: torch.Tensor, n: int) -> dict:
    """The leave-one-out marginal on the first n examples (loss without the upload minus with it: > 0 helped),
    its standard error over those examples, and their ratio."""
    d = (without[:n] - full[:n]) * n / tokens[:n].sum()
    marginal, error = float(d.mean()), float(d.std(unbiased=True) / n ** 0.5)
    return {"marginal": marginal, "error": error, "z": marginal / error if error > 0 else float("nan")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payloads", type=pathlib.Path, help="read (or keep) the ten uploads here")
    ap.add_argument("--ns", default=f"{SERVER_SCORING_EXAMPLES},200", help="scoring-set sizes, comma-separated "
                    "[default: the server's scoring_examples, and 200]")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    from zoo_gym.evaluation.evaluate import collate, tokenize_examples

    ns = [int(n) for n in args.ns.split(",")]
    cfg, t0 = L.Bench(rounds=1, pay_uploads=str(args.payloads or "")), time.time()
    base_dir = L.resolve_base(cfg.base)
    with tempfile.TemporaryDirectory(prefix="zoo-pay-loss-gate-") as tmp:
        ck, judge = L.Checkpoints(base_dir, pathlib.Path(tmp)), L.Judge(base_dir, cfg)
        ups, kinds = uploads(cfg, ck)
    deltas, shas = [d for _, d in ups], [hashlib.sha256(p).hexdigest() for p, _ in ups]
    accepted = [k != "free_rider_zero" for k in kinds]  # the server refuses the zero delta at upload
    questions = L.builtin_examples(cfg.task, split="validation", n=cfg.pay_server_n, seed=0)[:max(ns)]
    pairs = tokenize_examples(judge.tok, questions)
    batches = [collate(pairs[i:i + 50], pad_id=judge.tok.pad_token_id or 0) for i in range(0, len(pairs), 50)]

    def measure(members: list[int]):
        judge._load(L.plus(ck.base, L.step([deltas[i] for i in members])))  # noqa: SLF001
        return per_example_loss(judge.model, batches)

    everyone = [i for i in range(len(deltas)) if accepted[i]]
    full, tokens = measure(everyone)
    truth = [c["loo_exact_match_gain"] for c in json.loads((ROOT / "results" / "learning.json").read_text())["pay"]
             ["contributors"]]
    rows = []
    for i in range(len(deltas)):
        row = {"kind": kinds[i], "truth_loo_exact_match_gain": truth[i]}
        if accepted[i] and shas[i] not in shas[:i]:  # not refused, not a copy (it owns none of the content)
            without, _ = measure([j for j in everyone if shas[j] != shas[i]])
            row.update({f"n{n}": gated(without, full, tokens, n) for n in ns})
        rows.append(row)
        L.log(f"{kinds[i]} {i}: {row}")
    gated_honest = {f"n{n}": [i for i, r in enumerate(rows) if r["kind"].startswith("honest") and f"n{n}" in r
                              and r[f"n{n}"]["marginal"] > 0 and r[f"n{n}"]["z"] <= 1] for n in ns}
    return L.emit({"benchmark": "learning_pay_loss_gate", "scoring_set_sizes": ns, "leave_one_out": rows,
                   "honest_gains_the_gate_would_not_pay": gated_honest, "started": t0}, args.out)


if __name__ == "__main__":
    main()
