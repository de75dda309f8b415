"""Benchmark: BitDelta-domain Krum / Multi-Krum (and streamed trimmed mean) vs Flower's, same deltas.

Inputs: seeded synthetic BitDelta payloads (codec default layout: groups of 128 along each row,
float32 scales) for the built-in tiny model's parameter shapes or one 10k x 10k matrix (100M).
Contributors share a sign pattern; honest ones flip 1/4 of the bits, the last F flip 1/2 with 3x
scales, so the Krum choice is unambiguous. Every tensor is generated straight in packed form
(no dense base, no dense delta) from (seed, tensor, contributor).

Each measurement runs in a FRESH subprocess that generates ITS OWN inputs after its imports:
ours gets the packed payloads; Flower gets the same deltas decoded by the codec to dense float32
ndarrays (`aggregate_krum` results, or message-API `ArrayRecord`s), built contributor by
contributor. Memory: the peak RSS (VmHWM) is reset right after the imports
(`/proc/self/clear_refs`) and the baseline RSS is read then; the memory target compares the peak
ABOVE that baseline (the inputs held plus the call's working memory), because on the tiny model
the import footprint (torch, transformers: 250-340 MiB) dwarfs both sides' aggregation memory.
Raw peaks are reported too (`raw_rss_peak_ratio` in the summary). Ours loads its compiled
kernels (`packed_kernels.warm_up`, as gym-server does at start) after the imports and before
the baseline; that load is `warm_up_s`, not timed in the calls.
Timed: the whole Krum / Multi-Krum call. Ours = check every layout and lay every contributor's
tensors end to end (`PackedModel.build`: one compiled gather), packed distances + selection
(compiled XOR + popcount kernel), then
(Multi-Krum) the mean of the selected deltas straight from their bits (`model_mean`); Krum's result is the selected packed delta itself,
as Flower's legacy Krum returns its selected input array. Each side is called `--repeats` times
in its process (`--big-repeats` at 100M): the speedup compares best call with best call (warm,
as a server aggregating round after round runs), `first_call_speedup_*` the first calls (cold:
page faults of fresh buffers included). On the tiny model a call takes 1-3 ms (ours) and the
first few calls run with cold caches, so 10 calls are made there (`--repeats`) on both sides. Both sides get the same thread budget (`--threads`, all
cores by default): torch's, OpenMP's and numpy's BLAS (Flower's norms and dot products use it).
Distance error: each side's (n, n) matrix against a float64 reference of the decoded deltas.
Dense case `dense2M_n10` (what the Flower apps hand DeltaSoup): 10 float32 rows of 2M (shared weights
plus small deltas), the public `krum(rows, f=3)` / `multi_krum(rows, f=3, m=5)` against Flower's
`aggregate_krum(results, 3, 0 / 5)` on the same rows; target >= 10x at distance error <= 1e-6.

    python benchmarks/aggregation.py [--quick] [--threads N] [--cases tiny_n10,...]
                                     [--out benchmarks/results/aggregation.json]
    python benchmarks/aggregation.py --summarize benchmarks/results/aggregation.json  # targets met?
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

F, F_TRIM, GROUP = 2, 0.2, 128
_ROW_CHUNK_ELEMS = 1 << 20  # decode / reference work per row chunk: 4 MiB float32


def _rss_mb() -> float:
    """Peak RSS of this process since `_reset_peak()` (VmHWM), MiB; getrusage's lifetime peak
    where /proc is not there."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Start the peak RSS over from the current RSS (Linux: `5` to /proc/self/clear_refs), so
    transient peaks of the imports (torch, transformers) are not charged to the aggregation."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _current_rss_mb() -> float:
    """Resident set now, MiB (the baseline right after imports; import peaks are not counted)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _baseline() -> float:
    _reset_peak()
    return _current_rss_mb()


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


def decode_rows(p, r0: int, r1: int) -> np.ndarray:
    """float32 (r1 - r0, cols): rows r0..r1 of a BitDeltaPacked, decoded by the codec."""
    from zoo_gym.codec.bitdelta import unpack_bitdelta
    from zoo_gym.codec.layout import Groups

    sc = p.scales.numpy()
    g = Groups(size=p.group_size, n_groups=sc.shape[1], scale_rows=sc.shape[0])
    s = sc if sc.shape[0] == 1 else sc[r0:r1]
    return unpack_bitdelta(p.signs.numpy()[r0:r1], s, cols=p.cols, groups=g)


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    shapes = [tuple(s) for s in spec["shapes"]]
    n, seed, kind, m = spec["n"], spec["seed"], spec["kind"], spec.get("m", 1)
    repeats = spec.get("repeats", 1)
    out: dict = {}
    if kind == "ours":
        from zoo_gym.aggregation import multi_krum_select
        from zoo_gym.aggregation.distances import model_sq_distances
        from zoo_gym.aggregation.packed_mean import model_mean
        from zoo_gym.aggregation.packed_kernels import warm_up
        from zoo_gym.aggregation.packed_model import PackedModel

        t0 = time.perf_counter()
        warm_up()  # load the compiled kernels (as gym-server does at start), not timed below
        out["warm_up_s"] = time.perf_counter() - t0
        out["base_rss_mb"] = _baseline()
        models = [[packed_delta(t, i, s, seed, n) for t, s in enumerate(shapes)] for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pm = PackedModel.build(models)  # every tensor of every contributor, end to end
            dist = torch.from_numpy(model_sq_distances(pm))
            chosen = multi_krum_select(dist, f=F, m=m).tolist()
            t1 = time.perf_counter()
            if m == 1:
                result = [models[chosen[0]][t] for t in range(len(shapes))]  # the packed delta itself
            else:  # the mean of the chosen, straight from their bits: weight 0 for the others
                w = [1.0 if i in chosen else 0.0 for i in range(n)]
                result = model_mean(pm, weights=w)
            t2 = time.perf_counter()
            runs.append((t1 - t0, t2 - t1, t2 - t0))
            del result, pm
        best = min(range(repeats), key=lambda r: runs[r][2])
        out.update(select_s=runs[best][0], average_s=runs[best][1], seconds=runs[best][2],
                   first_s=runs[0][2], runs_s=[r[2] for r in runs],
                   distances=dist.numpy().tolist(), chosen=sorted(chosen))
    elif kind == "ours-trimmed":
        from zoo_gym.aggregation import trimmed_mean

        out["base_rss_mb"] = _baseline()
        ws = [[dense_delta(t, i, s, seed, n) for t, s in enumerate(shapes)] for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for t in range(len(shapes)):  # streamed tensor by tensor
                trimmed_mean(torch.from_numpy(np.stack([w[t].reshape(-1) for w in ws])), beta=F_TRIM)
            runs.append(time.perf_counter() - t0)
        out.update(seconds=min(runs), first_s=runs[0], runs_s=runs)
    elif kind in ("flower-legacy", "flower-trimmed"):
        import flwr.server.strategy.aggregate as agg

        out["base_rss_mb"] = _baseline()
        results = [([dense_delta(t, i, s, seed, n) for t, s in enumerate(shapes)], 1) for i in range(n)]
        out["inputs_rss_mb"] = _rss_mb()
        seen = {}
        original = agg._compute_distances

        def spy(weights):  # records Flower's own matrix; adds no work to the call
            seen["d"] = original(weights)
            return seen["d"]

        agg._compute_distances = spy
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if kind == "flower-legacy":
                res = agg.aggregate_krum(results, F, 0 if m == 1 else m)  # to_keep=0: plain Krum
            else:
                res = agg.aggregate_trimmed_avg(results, F_TRIM)
            runs.append(time.perf_counter() - t0)
            del res
        out.update(seconds=min(runs), first_s=runs[0], runs_s=runs)
        if "d" in seen:
            out["distances"] = np.asarray(seen["d"]).tolist()
            scores = [sorted(np.delete(row, j))[: n - F - 2] for j, row in enumerate(seen["d"])]
            out["chosen"] = sorted(np.argsort([sum(s) for s in scores], kind="stable")[:m].tolist())
    elif kind == "flower-msg":
        import flwr.serverapp.strategy.multikrum as mk
        from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
        from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

        out["base_rss_mb"] = _baseline()
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
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sel = mk.select_multikrum(contents, num_malicious_nodes=F, num_nodes_to_select=m)
            res = aggregate_arrayrecords(sel, "num-examples")
            runs.append(time.perf_counter() - t0)
            del res
        out.update(seconds=min(runs), first_s=runs[0], runs_s=runs)
        out["distances"] = np.asarray(seen["d"]).tolist()
        out["chosen"] = sorted(contents.index(c) for c in sel)
    elif kind.startswith("dense-"):
        out.update(dense_worker(spec))
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


DENSE_F, DENSE_M = 3, 5  # the dense case: multi_krum(rows, f=3, m=5) vs aggregate_krum(results, 3, 5)


def dense_rows(n: int, d: int, seed: int) -> np.ndarray:
    """(n, d) float32: shared weights plus small per-contributor deltas (full models, as Flower sends)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d, dtype=np.float32)
    return np.stack([base + 1e-2 * rng.standard_normal(d, dtype=np.float32) for _ in range(n)])


def dense_worker(spec: dict) -> dict:
    """One side of the dense case on the same rows: ours (public `multi_krum` / `krum`), Flower's
    legacy `aggregate_krum`, or the float64 reference (differences summed per row pair)."""
    import torch

    n, d, kind, m, repeats = spec["n"], spec["d"], spec["kind"], spec.get("m", 1), spec.get("repeats", 1)
    x = dense_rows(n, d, spec["seed"])
    out: dict = {}
    if kind == "dense-reference":
        xd = torch.from_numpy(x).double()
        out["distances"] = torch.stack([((xd[i] - xd) ** 2).sum(dim=1) for i in range(n)]).tolist()
        return out
    if kind == "dense-ours":
        from zoo_gym.aggregation import krum, multi_krum, pairwise_sq_distances
        from zoo_gym.aggregation.dense_kernels import warm_up

        warm_up()  # load the compiled kernels (as gym-server does at start)
        rows = torch.from_numpy(x)
        call = (lambda: krum(rows, f=DENSE_F)) if m == 1 else (lambda: multi_krum(rows, f=DENSE_F, m=m))
        out["distances"] = pairwise_sq_distances(rows).tolist()
    else:
        import flwr.server.strategy.aggregate as agg

        results = [([x[i]], 1) for i in range(n)]
        out["distances"] = np.asarray(agg._compute_distances([[x[i]] for i in range(n)])).tolist()
        call = lambda: agg.aggregate_krum(results, DENSE_F, 0 if m == 1 else m)  # noqa: E731
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        runs.append(time.perf_counter() - t0)
    out.update(seconds=min(runs), first_s=runs[0], runs_s=runs)
    return out


def dense_scenario(name: str, n: int, d: int, *, threads: int, repeats: int, seed: int = 0) -> dict:
    """Dense float32 rows (what Flower apps hand DeltaSoup): ours vs Flower's `aggregate_krum`."""
    base = {"n": n, "d": d, "seed": seed, "threads": threads, "repeats": repeats, "shapes": []}
    ref = run_worker({**base, "kind": "dense-reference"})
    res: dict = {"params": d, "n": n, "f": DENSE_F, "dense": True}
    for rule, m in (("krum", 1), ("multi-krum", DENSE_M)):
        ours = run_worker({**base, "kind": "dense-ours", "m": m})
        fl = run_worker({**base, "kind": "dense-flower", "m": m})
        if "error" in ours or "error" in fl:
            res[rule] = {"error": (ours.get("error") or fl.get("error"))[-400:]}
            continue
        res[rule] = {"m": m, "ours_s": ours["seconds"], "ours_runs_s": ours["runs_s"],
                     "flower_legacy_s": fl["seconds"], "flower_legacy_runs_s": fl["runs_s"],
                     "speedup_vs_flower_legacy": fl["seconds"] / ours["seconds"],
                     "first_call_speedup_vs_flower_legacy": fl["first_s"] / ours["first_s"],
                     "ours_dist_rel_err": rel_err(ours["distances"], ref["distances"]),
                     "flower_legacy_dist_rel_err": rel_err(fl["distances"], ref["distances"])}
    return {name: res}


def run_worker(spec: dict) -> dict:
    threads = str(spec["threads"])  # the same thread budget for numpy's BLAS, OpenMP and torch
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
           "MKL_NUM_THREADS": threads}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, check=False, env=env)
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


def scenario(name: str, shapes, n: int, *, threads: int, repeats: int, flower: bool = True,
             seed: int = 0, rules: tuple[str, ...] = ("krum", "multi-krum", "trimmed-mean")) -> dict:
    base = {"shapes": [list(s) for s in shapes], "n": n, "seed": seed, "threads": threads,
            "repeats": repeats}
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
               "ours_average_s": ours["average_s"], "ours_first_s": ours["first_s"],
               "ours_runs_s": ours["runs_s"], "ours_mem": _mem(ours),
               "ours_dist_rel_err": rel_err(ours["distances"], ref["distances"]),
               "ours_warm_up_s": ours["warm_up_s"],
               "ours_chosen": ours["chosen"]}
        for tag in ("flower-legacy", "flower-msg") if flower else ():
            fl = run_worker({**base, "kind": tag, "m": m})
            key = tag.replace("-", "_")
            if "error" in fl:
                row[f"{key}_error"] = fl["error"][-400:]
                continue
            row[f"{key}_s"] = fl["seconds"]
            row[f"{key}_first_s"] = fl["first_s"]
            row[f"{key}_runs_s"] = fl["runs_s"]
            row[f"{key}_mem"] = _mem(fl)
            row[f"{key}_dist_rel_err"] = rel_err(fl["distances"], ref["distances"])
            row[f"{key}_chosen"] = fl["chosen"]
            row[f"speedup_vs_{key}"] = fl["seconds"] / ours["seconds"]  # best run vs best run
            row[f"first_call_speedup_vs_{key}"] = fl["first_s"] / ours["first_s"]
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


def summary(report: dict) -> dict:
    """Per case and rule: each target against each Flower helper (best calls and first calls)."""
    out = {}
    for case, res in report.items():
        if not isinstance(res, dict) or "n" not in res:
            continue
        for rule in ("krum", "multi-krum"):
            row = res.get(rule, {})
            if res.get("dense"):  # dense target: >= 10x Flower's aggregate_krum at exact distances
                if "speedup_vs_flower_legacy" in row:
                    out[f"{case}/{rule}/flower_legacy"] = {
                        "speedup": round(row["speedup_vs_flower_legacy"], 2),
                        "first_call_speedup": round(row["first_call_speedup_vs_flower_legacy"], 2),
                        "met": bool(row["speedup_vs_flower_legacy"] >= 10 and row["ours_dist_rel_err"] <= 1e-6)}
                continue
            for key in ("flower_legacy", "flower_msg"):
                if f"speedup_vs_{key}" not in row:
                    continue
                out[f"{case}/{rule}/{key}"] = {
                    "speedup": round(row[f"speedup_vs_{key}"], 2),
                    "first_call_speedup": round(row[f"first_call_speedup_vs_{key}"], 2),
                    "peak_ratio": round(row[f"peak_minus_base_ratio_vs_{key}"], 4),
                    "raw_rss_peak_ratio": round(row[f"peak_ratio_vs_{key}"], 4),
                    "met": bool(row[f"speedup_vs_{key}"] >= 30
                                and row[f"peak_minus_base_ratio_vs_{key}"] <= 0.125
                                and row["ours_dist_rel_err"] <= 1e-6),
                }
    return out


def _ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--quick", action="store_true", help="tiny model n=10 and a 4M synthetic only")
    ap.add_argument("--no-big", action="store_true", help="skip the 100M-parameter cases")
    ap.add_argument("--cases", help="comma-separated case names to run (default: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for both sides: torch, OpenMP and numpy's BLAS (default: all cores)")
    ap.add_argument("--repeats", type=int, default=10, help="calls per measurement (best and first reported)")
    ap.add_argument("--big-repeats", type=int, default=2, help="calls per measurement at 100M parameters")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--summarize", metavar="JSON", help="print the targets summary of a saved run and exit")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.summarize:
        print(json.dumps(summary(json.loads(Path(args.summarize).read_text())), indent=1))
        return
    tiny = tiny_shapes()
    big = [(10_000, 10_000)]
    report: dict = {"f": F, "trim_beta": F_TRIM, "group_size": GROUP, "quick": args.quick,
                    "threads": args.threads, "cpu_count": os.cpu_count(), "ram_gb": round(_ram_gb(), 1),
                    "repeats": args.repeats, "big_repeats": args.big_repeats,
                    "targets": {"speedup": ">= 30", "peak_ratio": "<= 0.125", "dist_rel_err": "<= 1e-6",
                                "dense_speedup": ">= 10 (dense2M_n10: multi_krum(rows, f=3, m=5) vs aggregate_krum)"}}
    if args.quick:
        cases = [("tiny_n10", tiny, 10, True), ("synthetic4M_n10", [(2000, 2000)], 10, True)]
    else:
        cases = [("tiny_n10", tiny, 10, True), ("tiny_n30", tiny, 30, True)]
        if not args.no_big:
            # Flower at n=30 x 100M holds 12 GB of dense fp32 inputs plus a 12 GB flattened copy
            # (both helpers np.concatenate / stack all clients): only on a machine with the RAM
            flower30 = _ram_gb() >= 48
            cases += [("synthetic100M_n10", big, 10, True),
                      ("synthetic100M_n30" if flower30 else "synthetic100M_n30_ours_only", big, 30, flower30)]
    dense = [("dense2M_n10", 10, 2_000_000)]
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c[0] in keep]
        dense = [c for c in dense if c[0] in keep]
    t0 = time.perf_counter()
    for name, shapes, n, flower in cases:
        repeats = args.big_repeats if sum(int(np.prod(s)) for s in shapes) > 10_000_000 else args.repeats
        report.update(scenario(name, shapes, n, flower=flower, threads=args.threads, repeats=repeats))
    for name, n, d in dense:
        report.update(dense_scenario(name, n, d, threads=args.threads, repeats=args.repeats))
    report["wall_s"] = time.perf_counter() - t0
    report["summary"] = summary(report)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
