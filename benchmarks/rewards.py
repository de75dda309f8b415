"""Benchmark: cost of scoring a round relative to aggregating it, on the tiny model.

    python benchmarks/rewards.py [--contributors 10 50] [--repeats 3] [--out benchmarks/results/rewards.json]

Prints (and writes with --out) one JSON object. The round: n - 3 honest contributors (one SGD
step of norm 0.05 on their own disjoint training shard of 16 examples: a real, imperfect
direction), a zero delta, a random delta of honest norm and a sign-flip of an honest step. Every
delta is encoded as the client sends it (BitDelta, groups of 128), stored as bytes, and read back
through the server's own ``StoredDeltas`` source.

  aggregation_s   what the server pays to aggregate: DeltaSoup (Multi-Krum, f = (n - 3) // 2, DP
                  clipping at the median norm) over the stored payloads: manifest parse + decode
                  + packed distances + aggregate (median of `repeats`);
  methods         each scoring option, timed in the same process (median of `repeats`), with
                  ratio = seconds / aggregation_s (target <= 1 at n = 10), forward passes, and
                  whether the zero / random / sign-flip deltas were paid and how many honest were:
    exact_128         exact scoring (the reference for agreement): base loss, n solo losses,
                      GTG-Shapley subset losses (max_evaluations 32) on the 128 validation
                      examples, after decoding (padded batches);
    exact_32          the same on the 32-example scoring set;
    first_order_128   gradient at the base on 128 examples + streamed slopes + linear Shapley +
                      2 exact solo checks (score_round_first_order);
    first_order_32    the same on the 32-example scoring set (padded batches, slopes from a
                      second streamed decode);
    first_order_32_cached  the same with the base gradient computed before the round (it depends
                      only on the base and the scoring set): the cost left at settlement;
    first_order_32_tap     THE SERVER'S DEFAULT PATH and the target row: everything scoring adds
                      to a round. The base gradient on the packed scoring set (zoo_gym.evaluation.
                      packing: shared chat prefix once per row, no padding) is computed when the
                      base is published, in the same pass as the base's held-out loss
                      (evaluation/server_evaluator.py: the held-out loss needs the forward over the scoring
                      set anyway), so it is charged its measured fwd+bwd time minus a forward-only
                      pass over the same packed set, timed back to back in each repeat
                      (shared_forward_s); plus the SlopeTap's own seconds inside the aggregation
                      (one float64 mat-vec per tensor on rows it decodes anyway) + linear Shapley
                      and the formula + 2 exact checks on the packed set, reading the rows the tap
                      kept (no second decode);
    first_order_32_tap_unshared  the same with the whole gradient charged (forward included): the
                      first round after a server start, whose base was not published by this
                      process;
    first_order_32_tap_padded  the previous server path, for comparison in the same run: padded
                      batches for the gradient and the checks, the checks decode their payload;
    first_order_32_tap_cached  first_order_32_tap with the gradient computed before the round (it
                      depends only on the base and the scoring set): labelled, not the target.
                  The tap rows also give paired_aggregation_s / paired_ratio: the aggregation run
                  inside the same repeat (tap seconds excluded), so the ratio does not depend on
                  the machine's load drifting between the aggregation timing and the scoring
                  timing (the machine is shared); breakdown_median splits the seconds into
                  gradient_s, tap_s, exact_checks_s and scoring_s.
  agreement       share of contributors whose paid / not-paid decision equals exact_128's.
  noise (n = 10)  the scoring set's sampling noise: solo gains recomputed on the 4 disjoint
                  32-example quarters of the 128 validation examples; the median over honest
                  deltas of std(quarters) / |gain on 128|, and the share of (honest, quarter)
                  pairs whose gain sign flips.
  batched_forward (n = 10) torch.func.vmap over 8 stacked weight sets vs 8 sequential forward
                  passes on the 32-example set (one batch): seconds and ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time
import warnings

import torch
from safetensors.torch import load_file

from zoo_gym import codec
from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.gym_train import Evaluator, builtin_examples, default_validation_examples, tiny_model_dir
from zoo_gym.evaluation.evaluate import collate, tokenize_examples
from zoo_gym.rewards import (ContributionDiagnostics, FirstOrderConfig, ScoringConfig, SlopeTap,
                             accept_by_quality, base_gradient, score_round_detailed,
                             score_round_first_order, streamed_slopes)
from zoo_gym.evaluation.packing import PackedScoringSet
from zoo_gym.server.rounds.publish import StoredDeltas

SCORING_EXAMPLES = 32  # the scoring set: the first 32 of the server's validation examples


def _batches(evaluator: Evaluator, examples: list[dict]):
    pad = evaluator.tokenizer.pad_token_id or 0
    return [collate(tokenize_examples(evaluator.tokenizer, examples), pad_id=pad)]


def _deltas(evaluator: Evaluator, names: list[str], n: int, gen: torch.Generator):
    """n - 3 honest SGD steps (own shard), a zero, a random and a sign-flipped delta."""
    honest = []
    for i in range(n - 3):
        shard = builtin_examples("default", shard=i, n_shards=n, n=16, split="train", seed=i)
        g = base_gradient(evaluator.model, _batches(evaluator, shard))
        step = 0.05 / g.norm
        honest.append({k: -g.grad[k] * step for k in names})
    zero = {k: torch.zeros_like(v) for k, v in honest[0].items()}
    rand = {k: torch.randn(v.shape, generator=gen) for k, v in honest[0].items()}
    rn = math.sqrt(sum(float((v.double() ** 2).sum()) for v in rand.values()))
    rand = {k: v * (0.05 / rn) for k, v in rand.items()}
    flip = {k: -v for k, v in honest[1 % len(honest)].items()}
    return honest + [zero, rand, flip]


def _median_time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def _summary(scores, n: int, reference=None) -> dict:
    ok = accept_by_quality(scores)
    out = {"zero_delta_paid": ok[n - 3], "random_delta_paid": ok[n - 2],
           "sign_flip_paid": ok[n - 1], "honest_paid": sum(ok[: n - 3])}
    if reference is not None:
        out["agreement"] = round(sum(a == b for a, b in zip(ok, reference)) / n, 3)
    return out


def bench(n: int, *, full: Evaluator, small: Evaluator, packed: PackedScoringSet, base: dict,
          repeats: int, noise: bool) -> dict:
    names = [k for k in base]
    gen = torch.Generator().manual_seed(n)
    deltas = _deltas(full, names, n, gen)
    payloads = [codec.encode(d, codec="bitdelta", group_size=128) for d in deltas]
    ids = [f"c{i:03d}" for i in range(n)]
    f = max(0, (n - 3) // 2)
    norms0 = [math.sqrt(sum(float((v.double() ** 2).sum()) for v in d.values())) for d in deltas]
    soup = DeltaSoup(SoupConfig(aggregator="multi-krum", byzantine_f=f,
                                dp_clip=statistics.median(norms0)))

    def aggregate():
        source = StoredDeltas(payloads, ids, base)
        sink: dict[str, torch.Tensor] = {}
        return soup.run(source, lambda name, t: sink.__setitem__(name, t))

    agg_s, report = _median_time(aggregate, repeats)
    contribs = report.contributors
    clip = [c.clip_factor if c.accepted else 1.0 for c in contribs]
    used = [c.clip_factor * (1.0 if c.selected else 0.0) * (1.0 - c.trimmed_share) if c.accepted
            else 0.0 for c in contribs]
    weights = [max(c.weight, 0.0) if c.accepted else 0.0 for c in contribs]
    diags = [ContributionDiagnostics(
        accepted=c.accepted, reason=c.reason or "", selected=c.selected,
        trimmed_share=min(max(c.trimmed_share, 0.0), 1.0),
        clip_factor=min(max(c.clip_factor, 1e-12), 1.0) if c.accepted else 1.0,
        krum_score=c.score if c.score is not None else math.nan) for c in contribs]
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    passes = {"n": 0}

    def exact(evaluator: Evaluator):
        """settlement.py's path: decode all deltas, base + n solo + GTG subset losses."""
        source = StoredDeltas(payloads, ids, base)
        dense = [{} for _ in range(n)]
        for name in source.names():
            stacked = source.stacked(name)  # (n, numel)
            for i in range(n):
                dense[i][name] = stacked[i].reshape(shapes[name])

        def loss(delta):
            passes["n"] += 1
            return evaluator.loss(delta)

        b = loss(None)
        solo = [loss({k: v * clip[i] for k, v in dense[i].items()}) for i in range(n)]

        def subset_loss(s: frozenset[int]) -> float:
            tw = sum(weights[i] for i in s if used[i] > 0)
            if tw <= 0:
                return b
            merged = {k: torch.zeros(sh) for k, sh in shapes.items()}
            for i in s:
                if used[i] > 0:
                    for k in merged:
                        merged[k] += dense[i][k] * (used[i] * weights[i] / tw)
            return loss(merged)

        return score_round_detailed(ids, b, solo, diags, subset_loss,
                                    ScoringConfig(max_evaluations=32))

    def exact_solo_on(evaluator):
        """Exact solo loss of contributor i on `evaluator` (Evaluator or PackedScoringSet)."""
        def exact_solo(i: int) -> float:
            passes["n"] += 1
            return evaluator.loss(codec.decode(payloads[i]), scale=clip[i])  # this one only
        return exact_solo

    def first_order(evaluator: Evaluator, batches, cached=None):
        """Gradient (unless cached), a second streamed decode for the slopes, linear Shapley,
        top-k exact checks."""
        g = cached if cached is not None else base_gradient(evaluator.model, batches)
        source = StoredDeltas(payloads, ids, base)
        slopes, norms = streamed_slopes(g.grad, source, scales=clip)
        return _fo(g, slopes, norms, exact_solo_on(evaluator))

    def tapped(loss_on, gradient, cached=None, *, keep_rows=True, shared_forward=None):
        """The server's path: the slopes ride on the aggregation's own decode (SlopeTap);
        timed = gradient (unless cached) + the tap's own seconds + scoring + top-k checks (on
        the rows the tap kept, as settlement.py does; keep_rows=False: decode the payload again,
        the previous path). Returns (seconds, result, breakdown)."""
        shared_s = 0.0
        if shared_forward is not None:  # the held-out pass's own forward over the scoring set
            t0 = time.perf_counter()
            shared_forward()
            shared_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = cached if cached is not None else gradient()
        grad_s = time.perf_counter() - t0 - shared_s  # shared: only what the gradient adds
        tap = SlopeTap(StoredDeltas(payloads, ids, base), g.grad,
                       keep_bytes=(512 << 20) if keep_rows else 0)
        t0 = time.perf_counter()
        soup.run(tap, lambda name, t: None)  # the aggregation itself: not scoring's cost
        agg_paired = time.perf_counter() - t0 - tap.seconds  # this very aggregation, tap excluded
        checks = {"s": 0.0}
        if keep_rows:
            def exact_solo(i: int) -> float:
                passes["n"] += 1
                return loss_on.loss(tap.delta_of(i), scale=clip[i])
        else:
            exact_solo = exact_solo_on(loss_on)

        def timed_check(i: int) -> float:
            t = time.perf_counter()
            out = exact_solo(i)
            checks["s"] += time.perf_counter() - t
            return out

        t0 = time.perf_counter()
        slopes, norms = tap.result(scales=clip)
        res = _fo(g, slopes, norms, timed_check)
        rest = time.perf_counter() - t0
        total = grad_s + tap.seconds + rest
        return total, res, {"gradient_s": round(grad_s, 4),
                            "shared_forward_s": round(shared_s, 4), "tap_s": round(tap.seconds, 4),
                            "exact_checks_s": round(checks["s"], 4),
                            "scoring_s": round(rest - checks["s"], 4),
                            "paired_aggregation_s": round(agg_paired, 4),
                            "paired_ratio": round(total / agg_paired, 3)}

    def _fo(g, slopes, norms, exact_solo):
        return score_round_first_order(
            ids, base_loss=g.base_loss, grad_norm=g.norm, numel=g.numel, slopes=slopes,
            norms=norms, weights=[used[i] * weights[i] for i in range(n)], diagnostics=diags,
            config=ScoringConfig(), first_order=FirstOrderConfig(), exact_solo_loss=exact_solo)

    full_batches, small_batches = full._batches, small._batches  # noqa: SLF001 (same batches)
    cached = base_gradient(small.model, small_batches)
    packed_cached = packed.gradient()
    runs = {"exact_128": lambda: exact(full), "exact_32": lambda: exact(small),
            "first_order_128": lambda: first_order(full, full_batches),
            "first_order_32": lambda: first_order(small, small_batches),
            "first_order_32_cached": lambda: first_order(small, small_batches, cached),
            "first_order_32_tap": lambda: tapped(packed, packed.gradient,
                                                 shared_forward=lambda: packed.loss(None)),
            "first_order_32_tap_unshared": lambda: tapped(packed, packed.gradient),
            "first_order_32_tap_padded": lambda: tapped(
                small, lambda: base_gradient(small.model, small_batches), keep_rows=False),
            "first_order_32_tap_cached": lambda: tapped(packed, packed.gradient, packed_cached)}
    methods, reference = {}, None
    for name, fn in runs.items():
        passes["n"] = 0
        extra = {}
        if "tap" in name:
            timed = [fn() for _ in range(repeats)]
            t, res = statistics.median(x[0] for x in timed), timed[-1][1]
            med = {k: statistics.median(x[2][k] for x in timed) for k in timed[0][2]}
            extra = {"paired_ratio": round(med.pop("paired_ratio"), 3),
                     "paired_aggregation_s": round(med.pop("paired_aggregation_s"), 4),
                     "breakdown_median": {k: round(v, 4) for k, v in med.items()}}
        else:
            t, res = _median_time(fn, repeats)
        row = {"seconds": round(t, 4), "ratio": round(t / agg_s, 3),
               "forward_passes": passes["n"] // repeats, "marginal": res.estimate.method,
               "permutations": res.estimate.permutations, **_summary(res.scores, n, reference),
               **extra}
        if reference is None:
            reference = accept_by_quality(res.scores)
        methods[name] = row
    out = {"contributors": n, "byzantine_f": f, "aggregation_s": round(agg_s, 4),
           "selected": sum(c.selected for c in contribs if c.accepted), "methods": methods}
    if noise:
        out["noise"] = _noise(full, deltas[: n - 3])
        out["batched_forward"] = _batched(small, base)
    return out


def _noise(full: Evaluator, honest: list[dict]) -> dict:
    """Sampling noise of 32-example gains: the 4 disjoint quarters of the 128 examples."""
    examples = default_validation_examples(n=128)
    quarters = [Evaluator(None, examples[q * 32:(q + 1) * 32], model=full.model,
                          tokenizer=full.tokenizer) for q in range(4)]
    rel, flips, total = [], 0, 0
    base_full = full.loss(None)
    for d in honest:
        g_full = (base_full - full.loss(d)) / base_full
        gq = []
        for ev in quarters:
            b = ev.loss(None)
            gq.append((b - ev.loss(d)) / b)
        rel.append(statistics.pstdev(gq) / max(abs(g_full), 1e-12))
        flips += sum((x > 0) != (g_full > 0) for x in gq)
        total += len(gq)
    return {"honest_deltas": len(honest), "median_rel_std_of_gain_32": round(statistics.median(rel), 3),
            "sign_flip_share_32": round(flips / total, 3)}


def _batched(small: Evaluator, base: dict, k: int = 8) -> dict:
    from torch.func import functional_call, vmap

    model = small.model
    params = {n: p.detach() for n, p in model.named_parameters()}
    ids, mask, _ = small._batches[0]  # noqa: SLF001
    gen = torch.Generator().manual_seed(1)
    stacked = {n: p.unsqueeze(0) + 1e-3 * torch.randn((k,) + tuple(p.shape), generator=gen)
               for n, p in params.items()}

    def fwd(pp):
        return functional_call(model, pp, (), {"input_ids": ids, "attention_mask": mask}).logits

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        for j in range(k):
            fwd({n: v[j] for n, v in stacked.items()})
        seq = time.perf_counter() - t
        t = time.perf_counter()
        vmap(fwd)(stacked)
        vm = time.perf_counter() - t
    return {"weight_sets": k, "sequential_s": round(seq, 4), "vmap_s": round(vm, 4),
            "vmap_over_sequential": round(vm / seq, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contributors", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a loaded shared machine oversubscribes with more)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = tiny_model_dir()
    examples = default_validation_examples(n=128)
    full = Evaluator(model_dir, examples)
    small = Evaluator(None, examples[:SCORING_EXAMPLES], model=full.model, tokenizer=full.tokenizer)
    base = load_file(str(model_dir / "model.safetensors"))
    pad = full.tokenizer.pad_token_id or 0
    packed = PackedScoringSet(full.model, tokenize_examples(full.tokenizer, examples[:SCORING_EXAMPLES]),
                              pad_id=pad)
    rows = [bench(n, full=full, small=small, packed=packed, base=base, repeats=args.repeats,
                  noise=(i == 0))
            for i, n in enumerate(args.contributors)]
    at10 = next((r for r in rows if r["contributors"] == 10), None)
    result = {"benchmark": "rewards.scoring_vs_aggregation", "model": "shipped tiny model",
              "parameters": sum(p.numel() for p in full.model.parameters()),
              "validation_examples": len(examples), "scoring_examples": SCORING_EXAMPLES,
              "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "results": rows,
              "target": "first_order_32_tap ratio <= 1 at 10 contributors (gradient included), "
                        "both against the run's aggregation_s and paired with the aggregation run "
                        "inside each repeat",
              "target_met": None if at10 is None else (
                  at10["methods"]["first_order_32_tap"]["ratio"] <= 1
                  and at10["methods"]["first_order_32_tap"]["paired_ratio"] <= 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
