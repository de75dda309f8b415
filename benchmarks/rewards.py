"""Benchmark: cost of scoring a round relative to aggregating it, on the tiny model.

    python benchmarks/rewards.py [--contributors 10 50] [--repeats 3] [--validation-examples 128]

Prints one JSON object. For each n:
  aggregation_s   DeltaSoup (Multi-Krum, f = (n - 3) // 2, DP clipping) over n synthetic deltas
                  shaped like the tiny model's parameters (median of `repeats` runs);
  scoring_s       what the server does to score the round: the base loss, n solo losses
                  (base + clipped delta), the GTG-Shapley subset losses (bounded by
                  max_evaluations) and `score_round` itself (median of `repeats`);
  ratio           scoring_s / aggregation_s (target <= 1 at n = 10);
  forward_passes  validation-set evaluations the scoring made; seconds_per_forward;
  score_round_s   the rewards library's own maths (no loss evaluations), and its ratio;
  first_order     the same round scored from one gradient (first_order.py): time, ratio, and
                  whether the zero delta / sign-flip / honest ones pass the minimum quality.
The two are measured in the same process, one after the other, so the ratio is comparable
across machines even though the seconds are not.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import tempfile
import time

import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir
from zoo_gym.rewards import (ContributionDiagnostics, ScoringConfig, directional_slopes,
                             linear_losses, score_round_detailed)


def _validation_gradient(evaluator: Evaluator) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean completion loss and its gradient at the base: one forward + backward (the server's
    side of first-order scoring; written here because gym_train has no gradient API yet)."""
    model = evaluator.model
    model.zero_grad(set_to_none=True)
    total, count = None, 0
    for ids, mask, labels in evaluator._batches:  # noqa: SLF001 (the same pre-collated batches)
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        shift_labels = labels[:, 1:]  # (B, T-1)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
            ignore_index=-100, reduction="sum")
        total = loss if total is None else total + loss
        count += int((shift_labels != -100).sum())
    mean = total / max(count, 1)
    mean.backward()
    grad = {k: p.grad.detach().clone() for k, p in model.named_parameters(remove_duplicate=True)}
    model.zero_grad(set_to_none=True)
    return float(mean.detach()), grad


def _model_dir(tmp: pathlib.Path) -> tuple[pathlib.Path, str]:
    d = tiny_model_dir()
    if (d / "config.json").exists():
        return d, "shipped tiny model"
    from zoo_gym.gym_train.make_tiny import make_tiny  # not shipped yet: same architecture, untrained

    return make_tiny(tmp / "tiny", steps=0), "tiny architecture, untrained (timing only)"


def _synthetic_deltas(grad: dict[str, torch.Tensor], n: int, gen: torch.Generator):
    """n deltas: honest ones = a small step down the validation gradient + their own noise
    (norm 0.5x the step), one zero delta, one sign-flip of the step."""
    shapes = {k: g.shape for k, g in grad.items()}
    g_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grad.values())))
    common = {k: -g * (0.05 / g_norm) for k, g in grad.items()}  # whole-delta L2 norm 0.05
    d_total = sum(g.numel() for g in grad.values())
    out = []
    for i in range(n):
        if i == n - 2:
            out.append({k: torch.zeros(s) for k, s in shapes.items()})
        elif i == n - 1:
            out.append({k: -v for k, v in common.items()})
        else:
            out.append({k: v + torch.randn(v.shape, generator=gen) * (0.025 / d_total ** 0.5)
                        for k, v in common.items()})
    return out


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def bench(n: int, *, evaluator: Evaluator, repeats: int, scoring: ScoringConfig) -> dict:
    params = {k: p for k, p in evaluator.model.named_parameters(remove_duplicate=True)}
    shapes = {k: p.shape for k, p in params.items()}
    gen = torch.Generator().manual_seed(n)
    _, grad0 = _validation_gradient(evaluator)
    deltas = _synthetic_deltas(grad0, n, gen)
    ids = [f"c{i:03d}" for i in range(n)]
    source = DictDeltaSource(ids, deltas)
    f = max(0, (n - 3) // 2)
    norms = torch.stack([torch.sqrt(sum((v.double() ** 2).sum() for v in d.values())) for d in deltas])
    soup = DeltaSoup(SoupConfig(aggregator="multi-krum", byzantine_f=f,
                                dp_clip=float(norms.median())))

    def aggregate():
        sink: dict[str, torch.Tensor] = {}
        report = soup.run(source, lambda name, t: sink.__setitem__(name, t))
        return report

    agg_s, report = _median_time(aggregate, repeats)
    contribs = report.contributors
    used = [c.clip_factor * (1.0 if c.selected else 0.0) * (1.0 - c.trimmed_share) if c.accepted
            else 0.0 for c in contribs]
    weights = [max(c.weight, 0.0) if c.accepted else 0.0 for c in contribs]
    diags = [ContributionDiagnostics(
        accepted=c.accepted, reason=c.reason or "", selected=c.selected,
        trimmed_share=min(max(c.trimmed_share, 0.0), 1.0),
        clip_factor=min(max(c.clip_factor, 1e-12), 1.0) if c.accepted else 1.0,
        krum_score=c.score if c.score is not None else math.nan) for c in contribs]
    passes = {"n": 0}

    def loss(delta):
        passes["n"] += 1
        return evaluator.loss(delta)

    def score():
        passes["n"] = 0
        base = loss(None)
        solo = [loss({k: v * contribs[i].clip_factor for k, v in deltas[i].items()})
                for i in range(n)]

        def subset_loss(s: frozenset[int]) -> float:
            tw = sum(weights[i] for i in s if used[i] > 0)
            if tw <= 0:
                return base
            merged = {k: torch.zeros(sh) for k, sh in shapes.items()}
            for i in s:
                if used[i] > 0:
                    for k in shapes:
                        merged[k] += deltas[i][k] * (used[i] * weights[i] / tw)
            return loss(merged)

        res = score_round_detailed(ids, base, solo, diags, subset_loss, scoring)
        return res

    score_s, res = _median_time(score, repeats)
    forward = passes["n"]

    # the library's own maths, with the losses precomputed (table lookups)
    table: dict[frozenset[int], float] = {}
    base = evaluator.loss(None)

    def cached_subset(s):
        if s not in table:
            table[s] = 0.0 if not s else base - 1e-3 * len(s)
        return table[s]

    solo = [base - 1e-3 * (i % 3) for i in range(n)]
    lib_s, _ = _median_time(lambda: score_round_detailed(ids, base, solo, diags, cached_subset,
                                                         scoring), repeats)
    paid = [s.contributor for s in res.scores if s.score > 0]

    # first-order scoring: one forward + backward, then dot products (first_order.py)
    def score_first_order():
        base_fo, grad = _validation_gradient(evaluator)
        scaled = [{k: v * contribs[i].clip_factor for k, v in deltas[i].items()} for i in range(n)]
        slopes = directional_slopes(grad, scaled)
        w = [used[i] * weights[i] for i in range(n)]
        solo_fo, subset_fo = linear_losses(base_loss=base_fo, slopes=slopes, weights=w)
        return score_round_detailed(ids, base_fo, solo_fo, diags, subset_fo,
                                    ScoringConfig(max_evaluations=256, max_permutations=32))

    fo_s, fo = _median_time(score_first_order, repeats)
    from zoo_gym.rewards import accept_by_quality

    fo_ok = accept_by_quality(fo.scores)
    exact_ok = accept_by_quality(res.scores)
    return {"contributors": n, "byzantine_f": f, "aggregation_s": round(agg_s, 4),
            "scoring_s": round(score_s, 4), "ratio": round(score_s / agg_s, 3),
            "forward_passes": forward, "seconds_per_forward": round(score_s / max(forward, 1), 4),
            "marginal_method": res.estimate.method, "marginal_evaluations": res.estimate.evaluations,
            "permutations": res.estimate.permutations,
            "score_round_s": round(lib_s, 5), "score_round_ratio": round(lib_s / agg_s, 4),
            "zero_delta_paid": exact_ok[n - 2], "sign_flip_paid": exact_ok[n - 1],
            "honest_paid": sum(exact_ok[: n - 2]),
            "first_order": {"scoring_s": round(fo_s, 4), "ratio": round(fo_s / agg_s, 3),
                            "permutations": fo.estimate.permutations,
                            "zero_delta_paid": fo_ok[n - 2], "sign_flip_paid": fo_ok[n - 1],
                            "honest_paid": sum(fo_ok[: n - 2])}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contributors", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--validation-examples", type=int, default=128)
    ap.add_argument("--max-evaluations", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a loaded shared machine oversubscribes with more)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_note = _model_dir(pathlib.Path(tmp))
        examples = default_validation_examples(n=args.validation_examples)
        evaluator = Evaluator(model_dir, examples)
        scoring = ScoringConfig(max_evaluations=args.max_evaluations)
        n_params = sum(p.numel() for p in evaluator.model.parameters())
        rows = [bench(n, evaluator=evaluator, repeats=args.repeats, scoring=scoring)
                for n in args.contributors]
    print(json.dumps({"benchmark": "rewards.scoring_vs_aggregation", "model": model_note,
                      "parameters": n_params, "validation_examples": len(examples),
                      "max_evaluations": args.max_evaluations, "torch_threads": torch.get_num_threads(),
                      "results": rows,
                      "target": "ratio <= 1 at 10 contributors",
                      "target_met": next((r["ratio"] <= 1 for r in rows if r["contributors"] == 10), None)},
                     indent=2))


if __name__ == "__main__":
    main()
