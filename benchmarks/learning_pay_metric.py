"""Would the pay part rank better if the server scored on the answers' probability instead of exact match?

An offline check for issue 48 (pay's Spearman 0.60 against 0.7): the pay part's ten uploads of
`benchmarks/learning.py --rounds 1 --parts pay` (trained again here, or read from `--payloads DIR`), each one's
leave-one-out gain under the default rule on the server's 1000 validation questions, from one packed forward per
subset: greedy exact match (what the server scores on) and the mean teacher-forced probability of each whole
reference answer (its smooth counterpart). Each ranked (Spearman) against the truth in results/learning.json
(`pay.contributors[].loo_exact_match_gain`, 2000 other questions); the two sets' mix of sums and differences
is reported beside them (the contributors are skewed to one operation each). Prints JSON.

    python benchmarks/learning_pay_metric.py [--payloads DIR] [--out FILE]
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


def answer_logprobs(model, batch) -> torch.Tensor:
    """(examples,) each example's summed log-probability of its whole reference, from one packed forward."""
    from zoo_gym.evaluation.evaluate import HEAD_CHUNK_ELEMENTS, hidden_at
    from zoo_gym.evaluation.packed_batch import _packed_inputs  # noqa: PLC2701 - the scorer's own inputs

    with torch.no_grad():
        hidden = hidden_at(model, _packed_inputs(model, batch), batch.predict_at)     # (K, H)
        head = model.get_output_embeddings()
        step = max(1, HEAD_CHUNK_ELEMENTS // int(head.weight.shape[0]))
        per_token = torch.cat([head(hidden[i:i + step]).float().log_softmax(-1)
                               .gather(1, batch.targets[i:i + step, None]).squeeze(1)
                               for i in range(0, hidden.shape[0], step)])             # (K,)
    return torch.zeros(batch.examples).index_add_(0, batch.target_example, per_token)


def uploads(cfg, ck) -> tuple[list[tuple], list[str]]:
    """The pay part's uploads and kinds, as run_pay makes them (learning.kept_pay_uploads: kept in, or read from,
    `cfg.pay_uploads`)."""
    def first():
        ckpt = ck.write(ck.base, "round0")
        return [L.contributor_upload(ckpt, L.shard_examples(cfg, i, 1), cfg, 1) for i in range(cfg.contributors)]

    return L.kept_pay_uploads(cfg, ck, first)


def question_sets(cfg) -> dict[str, list[dict]]:
    """The server's 1000 validation questions, and the ground truth's 2000 (learning.leave_one_out's draw: train
    split questions no contributor of the pay round trained on), whose mix of sums and differences is reported."""
    return {"validation": L.builtin_examples(cfg.task, split="validation", n=cfg.pay_server_n, seed=0),
            "truth": L.truth_questions(cfg, L.pay_trained_questions(cfg))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payloads", type=pathlib.Path, help="read (or keep) the ten uploads here")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    from zoo_gym.evaluation.evaluate import tokenize_examples
    from zoo_gym.evaluation.packing import PackedScoringSet
    from zoo_gym.evaluation.packed_batch import packed_misses
    from zoo_gym.evaluation.server_evaluator import through_first

    cfg, t0 = L.Bench(rounds=1, pay_uploads=str(args.payloads or "")), time.time()
    base_dir = L.resolve_base(cfg.base)
    with tempfile.TemporaryDirectory(prefix="zoo-pay-metric-") as tmp:
        ck, judge = L.Checkpoints(base_dir, pathlib.Path(tmp)), L.Judge(base_dir, cfg)
        ups, kinds = uploads(cfg, ck)
    payloads, deltas = [p for p, _ in ups], [d for _, d in ups]
    shas = [hashlib.sha256(p).hexdigest() for p in payloads]
    accepted = [k != "free_rider_zero" for k in kinds]  # the server refuses the zero delta at upload
    sets = question_sets(cfg)
    mix = {n: {"items": len(e), "sums": sum(" + " in x["instruction"] for x in e) / len(e)} for n, e in sets.items()}
    del sets["truth"]  # its gains are the recorded truth's (leave_one_out): only its mix is reported
    batches = {name: PackedScoringSet(judge.model, [(p, through_first(c, judge.tok.eos_token_id)) for p, c in
                                                    tokenize_examples(judge.tok, exs)],
                                      pad_id=judge.tok.pad_token_id or 0).batch for name, exs in sets.items()}

    @torch.no_grad()  # a forward over 1000 questions that kept its activations would need ~50 GB
    def measure(members: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        judge._load(L.plus(ck.base, L.step([deltas[i] for i in members])))  # noqa: SLF001
        return {name: ((~packed_misses(judge.model, b)).float(), answer_logprobs(judge.model, b).exp())
                for name, b in batches.items()}

    everyone = [i for i in range(len(deltas)) if accepted[i]]  # the round the server ran, the copy included
    full = measure(everyone)
    rows = []
    for i in range(len(deltas)):
        row = {"kind": kinds[i]}
        if not accepted[i] or shas[i] in shas[:i]:  # refused, or a copy (it owns none of the content)
            rows.append({**row, **{f"{n}/{m}": 0.0 for n in sets for m in ("exact_match", "answer_probability")}})
            continue
        without = measure([j for j in everyone if shas[j] != shas[i]])
        for name, (right_all, p_all) in full.items():
            right, p = without[name]
            row[f"{name}/exact_match"] = float((right_all - right).mean())
            row[f"{name}/answer_probability"] = float((p_all - p).mean())
        rows.append(row)
        L.log(f"{kinds[i]} {i}: {row}")
    truth = [c["loo_exact_match_gain"] for c in json.loads((ROOT / "results" / "learning.json").read_text())["pay"]
             ["contributors"]]
    doc = {"benchmark": "learning_pay_metric", "question_sets": mix,
           "all": {n: {"exact_match": float(r.mean()), "answer_probability": float(p.mean())}
                   for n, (r, p) in full.items()},
           "leave_one_out": rows, "truth_loo_exact_match_gain": truth,
           "spearman_with_truth": {k: L.spearman(truth, [r[k] for r in rows]) for k in rows[0] if k != "kind"},
           "started": t0}
    return L.emit(doc, args.out)


if __name__ == "__main__":
    main()
