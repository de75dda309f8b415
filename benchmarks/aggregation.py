"""Benchmark: DeltaSoup's Krum / Multi-Krum / trimmed mean vs Flower's, on the same deltas.

Each measurement runs in a FRESH subprocess (peak RSS = resource.getrusage maxrss of that
process, so memory ratios are honest); every worker regenerates the same seeded deltas.
Ours gets the BitDelta-packed deltas (per-row scales) and computes distances from the bits;
Flower gets what it aggregates in practice, full float32 weights = base + decoded delta.
Distance error: each side's (n, n) squared-distance matrix against an exact float64
reference of its own input (pairwise differences in float64). Prints one JSON document.

    python benchmarks/aggregation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch

F, F_TRIM = 2, 0.2


def tiny_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the built-in tiny model (Qwen3, gym_train's TinySpec defaults)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=400, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    return [tuple(p.shape) for p in model.parameters()]


def _2d(shape):
    return (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))


def gen_tensor(t: int, i: int, shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, delta) of tensor t for contributor i, float32 2-D."""
    rows, cols = _2d(shape)
    gb = torch.Generator().manual_seed(seed * 1_000_003 + t)
    base = torch.randn(rows, cols, generator=gb) * 0.05
    gd = torch.Generator().manual_seed(seed * 1_000_003 + t * 7919 + i + 1)
    delta = 1e-3 * torch.randn(rows, cols, generator=gd)
    return base, delta


def packed_delta(t, i, shape, seed):
    from zoo_gym.codec.bitdelta import BitDeltaPacked, pack_bitdelta
    from zoo_gym.codec.layout import groups_for

    _, delta = gen_tensor(t, i, shape, seed)
    rows, cols = delta.shape
    groups = groups_for(rows=rows, cols=cols, group_size=None, codec="bitdelta")
    signs, scales = pack_bitdelta(delta, groups=groups)
    return BitDeltaPacked(shape=tuple(shape), rows=rows, cols=cols, group_size=groups.size,
                          signs=torch.from_numpy(signs),
                          scales=torch.from_numpy(scales.astype(np.float32)))


def flower_weights(shapes, n, seed):
    """Flower's input: per contributor a list of float32 weight arrays (base + decoded delta)."""
    out = []
    for i in range(n):
        arrays = []
        for t, shape in enumerate(shapes):
            p = packed_delta(t, i, shape, seed)
            base, _ = gen_tensor(t, i, shape, seed)
            arrays.append((base + p.to_dense()).numpy().reshape(shape))
        out.append(arrays)
    return out


def exact_distances(rows_fn, n) -> np.ndarray:
    """float64 pairwise squared distances by direct differences; rows_fn(t) -> (n, numel) or None."""
    d = np.zeros((n, n))
    t = 0
    while (x := rows_fn(t)) is not None:
        for s in range(0, x.shape[1], 1 << 16):
            c = x[:, s:s + (1 << 16)].astype(np.float64)
            d += ((c[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        t += 1
    return d


def worker(spec: dict) -> dict:
    shapes = [tuple(s) for s in spec["shapes"]]
    n, seed, kind = spec["n"], spec["seed"], spec["kind"]
    out: dict = {}
    if kind == "ours-packed":
        from zoo_gym.aggregation.distances import packed_pairwise_sq_distances
        from zoo_gym.aggregation.krum import multi_krum_select

        packed = [[packed_delta(t, i, s, seed) for i in range(n)] for t, s in enumerate(shapes)]
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        dist = sum(packed_pairwise_sq_distances(p) for p in packed)
        chosen = multi_krum_select(dist, f=F, m=spec["m"]).tolist()
        agg = [torch.stack([p[i].to_dense() for i in chosen]).mean(0) for p in packed]
        out["seconds"] = time.perf_counter() - t0
        out["distances"] = dist.numpy().tolist()
        del agg
    elif kind == "ours-trimmed":
        from zoo_gym.aggregation import trimmed_mean

        ws = flower_weights(shapes, n, seed)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        for t in range(len(shapes)):  # streamed tensor by tensor
            trimmed_mean(torch.from_numpy(np.stack([w[t].reshape(-1) for w in ws])), beta=F_TRIM)
        out["seconds"] = time.perf_counter() - t0
    elif kind.startswith("flower"):
        ws = flower_weights(shapes, n, seed)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if kind == "flower-legacy-krum":
            from flwr.server.strategy.aggregate import _compute_distances, aggregate_krum

            results = [(w, 1) for w in ws]
            t0 = time.perf_counter()
            aggregate_krum(results, F, spec["m"])
            out["seconds"] = time.perf_counter() - t0
            out["distances"] = _compute_distances(ws).tolist()
        elif kind == "flower-msg-multikrum":
            from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
            from flwr.serverapp.strategy.multikrum import compute_distances, select_multikrum
            from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

            contents = [RecordDict({"arrays": ArrayRecord({str(k): Array(a) for k, a in enumerate(w)}),
                                    "metrics": MetricRecord({"num-examples": 1})}) for w in ws]
            del ws
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            sel = select_multikrum(contents, num_malicious_nodes=F, num_nodes_to_select=spec["m"])
            aggregate_arrayrecords(sel, "num-examples")
            out["seconds"] = time.perf_counter() - t0
            out["distances"] = compute_distances([c["arrays"] for c in contents]).tolist()
        elif kind == "flower-trimmed":
            from flwr.server.strategy.aggregate import aggregate_trimmed_avg

            t0 = time.perf_counter()
            aggregate_trimmed_avg([(w, 1) for w in ws], F_TRIM)
            out["seconds"] = time.perf_counter() - t0
    elif kind == "reference":
        rss0 = 0
        decoded = lambda t: None if t >= len(shapes) else np.stack(  # noqa: E731
            [packed_delta(t, i, shapes[t], seed).to_dense().numpy().reshape(-1) for i in range(n)])

        def weights(t):
            if t >= len(shapes):
                return None
            rows = []
            for i in range(n):
                base, _ = gen_tensor(t, i, shapes[t], seed)
                rows.append((base + packed_delta(t, i, shapes[t], seed).to_dense()).numpy().reshape(-1))
            return np.stack(rows)

        out["deltas"] = exact_distances(decoded, n).tolist()
        out["weights"] = exact_distances(weights, n).tolist()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["input_rss_mb"] = rss0 / 1024
    return out


def run_worker(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_err(d, ref) -> float:
    d, ref = np.asarray(d), np.asarray(ref)
    off = ~np.eye(len(ref), dtype=bool)
    return float(np.max(np.abs(d[off] - ref[off]) / ref[off]))


def scenario(name, shapes, n, seed=0) -> dict:
    base = {"shapes": [list(s) for s in shapes], "n": n, "seed": seed}
    ref = run_worker({**base, "kind": "reference"})
    res: dict = {"params": int(sum(np.prod(s) for s in shapes)), "n": n}
    for rule, m in (("krum", 1), ("multi-krum", n - F)):
        ours = run_worker({**base, "kind": "ours-packed", "m": m})
        legacy = run_worker({**base, "kind": "flower-legacy-krum", "m": m})
        msg = run_worker({**base, "kind": "flower-msg-multikrum", "m": m})
        row = {"ours_s": ours.get("seconds"), "ours_peak_mb": ours.get("peak_rss_mb"),
               "ours_dist_rel_err": rel_err(ours["distances"], ref["deltas"]) if "distances" in ours else None}
        for tag, fl in (("flower_legacy", legacy), ("flower_msg", msg)):
            if "error" in fl:
                row[f"{tag}_error"] = fl["error"][-300:]
                continue
            row[f"{tag}_s"] = fl["seconds"]
            row[f"{tag}_peak_mb"] = fl["peak_rss_mb"]
            row[f"{tag}_dist_rel_err"] = rel_err(fl["distances"], ref["weights"])
            row[f"speedup_vs_{tag}"] = fl["seconds"] / ours["seconds"]
            row[f"peak_mem_ratio_vs_{tag}"] = ours["peak_rss_mb"] / fl["peak_rss_mb"]
        res[rule] = row
    ot = run_worker({**base, "kind": "ours-trimmed"})
    ft = run_worker({**base, "kind": "flower-trimmed"})
    res["trimmed-mean"] = {"ours_s": ot.get("seconds"), "flower_s": ft.get("seconds"),
                           "ours_peak_mb": ot.get("peak_rss_mb"), "flower_peak_mb": ft.get("peak_rss_mb"),
                           "speedup": (ft["seconds"] / ot["seconds"]) if "seconds" in ot and "seconds" in ft else None}
    return {name: res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--quick", action="store_true", help="tiny model n=10 and a 4M synthetic only")
    ap.add_argument("--no-big", action="store_true", help="skip the 100M-parameter case")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    torch.set_num_threads(2)
    tiny = tiny_shapes()
    report: dict = {"machine": {"torch_threads": torch.get_num_threads()}, "f": F, "trim_beta": F_TRIM}
    if args.quick:
        cases = [("tiny_n10", tiny, 10), ("synthetic4M_n10", [(2000, 2000)], 10)]
    else:
        cases = [("tiny_n10", tiny, 10), ("tiny_n30", tiny, 30)]
        if not args.no_big:
            cases.append(("synthetic100M_n10", [(10_000, 10_000)], 10))
    for name, shapes, n in cases:
        report.update(scenario(name, shapes, n))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
