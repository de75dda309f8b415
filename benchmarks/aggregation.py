"""Benchmark: BitDelta-domain Krum / Multi-Krum (and streamed trimmed mean) vs Flower's, same deltas.

Inputs: seeded synthetic BitDelta payloads (codec default layout: groups of 128 along each row,
float32 scales) for the built-in tiny model's parameter shapes or one 10k x 10k matrix (100M).
Contributors share a sign pattern; honest ones flip 1/4 of the bits, the last F flip 1/2 with 3x
scales, so the Krum choice is unambiguous. Every tensor is generated straight in packed form
(no dense base, no dense delta) from (seed, tensor, contributor).

Each measurement runs in a FRESH subprocess that generates ITS OWN inputs after its imports:
ours gets the packed payloads; Flower gets the same deltas decoded by the codec to dense float32
ndarrays (`aggregate_krum` results, or message-API `ArrayRecord`s), built contributor by
contributor. Peak RSS = getrusage maxrss; reported raw and minus the process baseline measured
right after imports (torch is imported on both sides: the codec decodes Flower's inputs).
Timed: the whole Krum / Multi-Krum call. Ours = whole-model packed distances + selection, then
(Multi-Krum) the mean of the selected deltas decoded tensor by tensor in row chunks; Krum's result
is the selected packed delta itself, as Flower's legacy Krum returns its selected input array.
Distance error: each side's (n, n) matrix against a float64 reference of the decoded deltas.

    python benchmarks/aggregation.py [--quick] [--out benchmarks/results/aggregation.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

F, F_TRIM, GROUP = 2, 0.2, 128
_ROW_CHUNK_ELEMS = 1 << 20  # decode / reference work per row chunk: 4 MiB float32


def _rss_mb() -> float:
    """Peak RSS of this process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    """Resident set now, MiB (the baseline right after imports; import peaks are not counted)."""
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the built-in tiny model (Qwen3, gym_train's TinySpec defaults)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=400, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    return [tuple(p.shape) for p in model.parameters()]


def _2d(shape) -> tuple[int, int]:
    return (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))


def packed_delta(t: int, i: int, shape, seed: int, n: int):
    """Contributor i's BitDeltaPacked tensor t, generated in packed form."""
    import torch

    from zoo_gym.codec.bitdelta import BitDeltaPacked
    from zoo_gym.codec.layout import groups_for

    rows, cols = _2d(shape)
    g = groups_for(rows=rows, cols=cols, group_size=GROUP, codec="bitdelta")
    nbytes = -(-cols // 8)
    common = np.random.default_rng([seed, t]).integers(0, 256, (rows, nbytes), dtype=np.uint8)
    rng = np.random.default_rng([seed, t, i + 1])
    flip = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    byz = i >= n - F
    if not byz:  # honest: flip 1/4 of the signs
        flip &= rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    signs = common ^ flip
    if cols % 8:
        signs[:, -1] &= np.uint8((1 << (cols % 8)) - 1)  # padding bits stay 0
    scales = (1e-3 * (1.0 + 0.2 * rng.random((rows, g.n_groups))) * (3.0 if byz else 1.0))
    return BitDeltaPacked(shape=tuple(shape), rows=rows, cols=cols, group_size=g.size,
                          signs=torch.from_numpy(signs),
                          scales=torch.from_numpy(scales.astype(np.float32)))


def dense_delta(t, i, shape, seed, n) -> np.ndarray:
    return packed_delta(t, i, shape, seed, n).to_dense().numpy().reshape(shape)


def decode_rows(p, r0: int, r1: int, *, weight: float = 1.0) -> np.ndarray:
    """float32 (r1 - r0, cols): rows r0..r1 of weight * (a BitDeltaPacked), decoded by the codec
    (the weight is folded into the float32 scales: no extra pass over the elements)."""
    from zoo_gym.codec.bitdelta import unpack_bitdelta
    from zoo_gym.codec.layout import Groups

    sc = p.scales.numpy() if weight == 1.0 else (p.scales.numpy() * np.float32(weight))
    g = Groups(size=p.group_size, n_groups=sc.shape[1], scale_rows=sc.shape[0])
    s = sc if sc.shape[0] == 1 else sc[r0:r1]
    return unpack_bitdelta(p.signs.numpy()[r0:r1], s, cols=p.cols, groups=g)


def packed_mean(packed: list, coeff: list[float]):
    """(rows, cols) float32 sum_i coeff_i * decode(packed_i), straight from the packed bits
    (zoo_gym.aggregation.packed_mean: bit-transposed codes of 8 contributors, per-group tables)."""
    from zoo_gym.aggregation.packed_mean import packed_mean as fast_mean

    return fast_mean(packed, weights=coeff)


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(2)
    shapes = [tuple(s) for s in spec["shapes"]]
    n, seed, kind, m = spec["n"], spec["seed"], spec["kind"], spec.get("m", 1)
    out: dict = {}
    if kind == "ours":
        from zoo_gym.aggregation import multi_krum_select
        from zoo_gym.aggregation.distances import packed_model_sq_distances

        out["base_rss_mb"] = _current_rss_mb()
        models = [[packed_delta(t, i, s, seed, n) for t, s in enumerate(shapes)] for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        t0 = time.perf_counter()
        dist = packed_model_sq_distances(models)
        chosen = multi_krum_select(dist, f=F, m=m).tolist()
        t1 = time.perf_counter()
        if m == 1:
            result = [models[chosen[0]][t] for t in range(len(shapes))]  # the packed delta itself
        else:
            result = [packed_mean([models[i][t] for i in chosen], [1.0 / m] * m)
                      for t in range(len(shapes))]
        t2 = time.perf_counter()
        out.update(select_s=t1 - t0, average_s=t2 - t1, seconds=t2 - t0,
                   distances=dist.numpy().tolist(), chosen=sorted(chosen))
        del result
    elif kind == "ours-trimmed":
        from zoo_gym.aggregation import trimmed_mean

        out["base_rss_mb"] = _current_rss_mb()
        ws = [[dense_delta(t, i, s, seed, n) for t, s in enumerate(shapes)] for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        t0 = time.perf_counter()
        for t in range(len(shapes)):  # streamed tensor by tensor
            trimmed_mean(torch.from_numpy(np.stack([w[t].reshape(-1) for w in ws])), beta=F_TRIM)
        out["seconds"] = time.perf_counter() - t0
    elif kind in ("flower-legacy", "flower-trimmed"):
        import flwr.server.strategy.aggregate as agg

        out["base_rss_mb"] = _current_rss_mb()
        results = [([dense_delta(t, i, s, seed, n) for t, s in enumerate(shapes)], 1) for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        seen = {}
        original = agg._compute_distances

        def spy(weights):  # records Flower's own matrix; adds no work to the call
            seen["d"] = original(weights)
            return seen["d"]

        agg._compute_distances = spy
        t0 = time.perf_counter()
        if kind == "flower-legacy":
            res = agg.aggregate_krum(results, F, 0 if m == 1 else m)  # to_keep=0: plain Krum
        else:
            res = agg.aggregate_trimmed_avg(results, F_TRIM)
        out["seconds"] = time.perf_counter() - t0
        if "d" in seen:
            out["distances"] = np.asarray(seen["d"]).tolist()
            scores = [sorted(np.delete(row, j))[: n - F - 2] for j, row in enumerate(seen["d"])]
            out["chosen"] = sorted(np.argsort([sum(s) for s in scores], kind="stable")[:m].tolist())
        del res
    elif kind == "flower-msg":
        import flwr.serverapp.strategy.multikrum as mk
        from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
        from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

        out["base_rss_mb"] = _current_rss_mb()
        contents = []
        for i in range(n):  # one contributor's dense arrays alive at a time
            arrays = ArrayRecord({str(t): Array(dense_delta(t, i, s, seed, n)) for t, s in enumerate(shapes)})
            contents.append(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}))
        out["inputs_rss_mb"] = _rss_mb()
        seen = {}
        original = mk.compute_distances

        def spy(records):
            seen["d"] = original(records)
            return seen["d"]

        mk.compute_distances = spy
        t0 = time.perf_counter()
        sel = mk.select_multikrum(contents, num_malicious_nodes=F, num_nodes_to_select=m)
        res = aggregate_arrayrecords(sel, "num-examples")
        out["seconds"] = time.perf_counter() - t0
        out["distances"] = np.asarray(seen["d"]).tolist()
        out["chosen"] = sorted(contents.index(c) for c in sel)
        del res
    elif kind == "reference":  # float64, decoded by the codec, centred Gram per row chunk
        d = torch.zeros((n, n), dtype=torch.float64)
        for t, s in enumerate(shapes):
            ps = [packed_delta(t, i, s, seed, n) for i in range(n)]
            step = max(1, _ROW_CHUNK_ELEMS // ps[0].cols)
            for r0 in range(0, ps[0].rows, step):
                x = torch.stack([torch.from_numpy(decode_rows(p, r0, r0 + step).reshape(-1))
                                 for p in ps]).double()  # (n, chunk)
                x = x - x.mean(dim=0, keepdim=True)
                sq = (x * x).sum(dim=1)
                d += sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
        d.fill_diagonal_(0.0)
        out["distances"] = d.tolist()
    out["peak_rss_mb"] = _rss_mb()
    return out


def run_worker(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_err(d, ref) -> float:
    d, ref = np.asarray(d), np.asarray(ref)
    off = ~np.eye(len(ref), dtype=bool)
    return float(np.max(np.abs(d[off] - ref[off]) / ref[off]))


def _mem(res: dict) -> dict:
    return {"peak_mb": res["peak_rss_mb"], "peak_minus_base_mb": res["peak_rss_mb"] - res["base_rss_mb"],
            "base_mb": res["base_rss_mb"]}


def scenario(name: str, shapes, n: int, *, flower: bool = True, seed: int = 0,
             rules: tuple[str, ...] = ("krum", "multi-krum", "trimmed-mean")) -> dict:
    base = {"shapes": [list(s) for s in shapes], "n": n, "seed": seed}
    ref = run_worker({**base, "kind": "reference"})
    res: dict = {"params": int(sum(np.prod(s) for s in shapes)), "n": n, "tensors": len(shapes)}
    for rule, m in (("krum", 1), ("multi-krum", n - F)):
        if rule not in rules:
            continue
        ours = run_worker({**base, "kind": "ours", "m": m})
        if "error" in ours:
            res[rule] = {"ours_error": ours["error"]}
            continue
        row = {"ours_s": ours["seconds"], "ours_select_s": ours["select_s"],
               "ours_average_s": ours["average_s"], "ours_mem": _mem(ours),
               "ours_dist_rel_err": rel_err(ours["distances"], ref["distances"]),
               "ours_chosen": ours["chosen"]}
        for tag in ("flower-legacy", "flower-msg") if flower else ():
            fl = run_worker({**base, "kind": tag, "m": m})
            key = tag.replace("-", "_")
            if "error" in fl:
                row[f"{key}_error"] = fl["error"][-400:]
                continue
            row[f"{key}_s"] = fl["seconds"]
            row[f"{key}_mem"] = _mem(fl)
            row[f"{key}_dist_rel_err"] = rel_err(fl["distances"], ref["distances"])
            row[f"{key}_chosen"] = fl["chosen"]
            row[f"speedup_vs_{key}"] = fl["seconds"] / ours["seconds"]
            row[f"peak_ratio_vs_{key}"] = ours["peak_rss_mb"] / fl["peak_rss_mb"]
            fl_extra = fl["peak_rss_mb"] - fl["base_rss_mb"]
            row[f"peak_minus_base_ratio_vs_{key}"] = (
                (ours["peak_rss_mb"] - ours["base_rss_mb"]) / fl_extra if fl_extra > 0 else None)
        res[rule] = row
    if flower and res["params"] <= 10_000_000 and "trimmed-mean" in rules:  # 100M: (n, 100M) fp32 stacks + sorts, > 8 GB
        ot = run_worker({**base, "kind": "ours-trimmed"})
        ft = run_worker({**base, "kind": "flower-trimmed"})
        if "error" in ot or "error" in ft:
            res["trimmed-mean"] = {"error": (ot.get("error") or ft.get("error"))[-400:]}
        else:
            res["trimmed-mean"] = {"ours_s": ot["seconds"], "flower_s": ft["seconds"],
                                   "speedup": ft["seconds"] / ot["seconds"],
                                   "ours_mem": _mem(ot), "flower_mem": _mem(ft)}
    return {name: res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--quick", action="store_true", help="tiny model n=10 and a 4M synthetic only")
    ap.add_argument("--no-big", action="store_true", help="skip the 100M-parameter cases")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--only-100m-multikrum", metavar="KEY",
                    help="run only the 100M n=10 Multi-Krum case and merge it into --out under KEY")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.only_100m_multikrum:
        t0 = time.perf_counter()
        res = scenario("synthetic100M_n10", [(10_000, 10_000)], 10, rules=("multi-krum",))
        res["synthetic100M_n10"]["wall_s"] = time.perf_counter() - t0
        report = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else {}
        report[args.only_100m_multikrum] = res["synthetic100M_n10"]
        print(json.dumps(res, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return
    tiny = tiny_shapes()
    report: dict = {"f": F, "trim_beta": F_TRIM, "group_size": GROUP, "quick": args.quick,
                    "targets": {"speedup": ">= 30", "peak_ratio": "<= 0.125", "dist_rel_err": "<= 1e-6"}}
    if args.quick:
        cases = [("tiny_n10", tiny, 10, True), ("synthetic4M_n10", [(2000, 2000)], 10, True)]
    else:
        cases = [("tiny_n10", tiny, 10, True), ("tiny_n30", tiny, 30, True)]
        if not args.no_big:
            cases += [("synthetic100M_n10", [(10_000, 10_000)], 10, True),
                      # Flower at n=30 x 100M needs 12 GB of dense fp32 inputs plus a 12 GB
                      # flattened copy (both helpers np.concatenate/stack all clients): > 24 GB
                      ("synthetic100M_n30_ours_only", [(10_000, 10_000)], 30, False)]
    t0 = time.perf_counter()
    for name, shapes, n, flower in cases:
        report.update(scenario(name, shapes, n, flower=flower))
    report["wall_s"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
