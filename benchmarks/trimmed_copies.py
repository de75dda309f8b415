"""Benchmark: what counting copies once costs DeltaSoup's trimmed mean (the server's default rule) at a real
layer size. Prints JSON.

    python benchmarks/trimmed_copies.py [--layers 2] [--n 10] [--copies 3] [--repeats 3] [--out FILE]

Inputs: `--layers` decoder layers of Qwen3-0.6B's shapes (q 2048x1024, k and v 1024x1024, o 1024x2048, gate
and up 3072x1024, down 1024x3072: 15.7M parameters per layer), random deltas for `--n` contributors, the last
`--copies` of them one identical row (colluders), BitDelta-encoded by the codec (groups of 128, its default
scales), held in memory as packed bits and as the decoded rows (`DictDeltaSource`, as the server's source hands them out).
Timed, alternately in one process (each side first every other repeat): `DeltaSoup(trimmed-mean, beta
0.1).run` as it is now (a whole-model packed distance pass, the groups, the rule on one row per group) and
the same with the copies pass switched off (the rule before: `soup._NEEDS_DISTANCES` without the trimmed
mean). Reported: best of `--repeats` each,
their ratio, and the distance pass alone. In memory the rows cost no decoding, which the server's source
pays on every pass, so the ratio here is an upper bound for the server's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np
import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation import soup as soup_module
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.codec.bitdelta import BitDeltaPacked
from zoo_gym.codec.leaf import encode_leaf, packed_leaf

# Qwen3-0.6B's decoder-layer weights (out, in): hidden 1024, 16 query heads and 8 KV heads of 128, MLP 3072
LAYER_SHAPES = {"q_proj": (2048, 1024), "k_proj": (1024, 1024), "v_proj": (1024, 1024), "o_proj": (1024, 2048),
                "gate_proj": (3072, 1024), "up_proj": (3072, 1024), "down_proj": (1024, 3072)}


def packed(x: torch.Tensor, name: str) -> BitDeltaPacked:
    """BitDelta-encode a tensor as a client does (groups of 128, the codec's default scales) and read back the
    packed view the server aggregates from."""
    leaf = encode_leaf(x, codec="bitdelta", group_size=128, scale_dtype=None, what=name)
    return packed_leaf(leaf.data, leaf.scales, shape=leaf.shape, group_size=leaf.group_size,
                       scale_dtype=leaf.scale_dtype, what=name)


def inputs(layers: int, n: int, copies: int, seed: int = 0) -> DictDeltaSource:
    gen = torch.Generator().manual_seed(seed)
    dense: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    bits: list[dict[str, BitDeltaPacked]] = [{} for _ in range(n)]
    for layer in range(layers):
        for proj, shape in LAYER_SHAPES.items():
            name = f"model.layers.{layer}.{proj}.weight"
            common = torch.randn(shape, generator=gen) * 1e-3
            crafted = None
            for i in range(n):
                if i >= n - copies and crafted is not None:
                    p = crafted  # a colluder: the same row as the first colluder
                else:
                    p = packed(common + torch.randn(shape, generator=gen) * 1e-3, name)
                    crafted = p if i == n - copies else crafted
                bits[i][name] = p
                dense[i][name] = p.to_dense()
    return DictDeltaSource([f"c{i}" for i in range(n)], dense, packed=bits)


def run_once(source: DictDeltaSource, *, copies_pass: bool) -> tuple[float, list[float]]:
    saved = soup_module._NEEDS_DISTANCES
    if not copies_pass:  # the trimmed mean as it was: no distance pass, no groups
        soup_module._NEEDS_DISTANCES = tuple(r for r in saved if r not in ("trimmed-mean", "median"))
    try:
        t = time.perf_counter()
        report = DeltaSoup(SoupConfig(aggregator="trimmed-mean", trim_beta=0.1)).run(source, lambda *a: None)
        return time.perf_counter() - t, [c.weight for c in report.contributors]
    finally:
        soup_module._NEEDS_DISTANCES = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of Qwen3-0.6B's shapes (15.7M each)")
    ap.add_argument("--n", type=int, default=10, help="contributors")
    ap.add_argument("--copies", type=int, default=3, help="of them, colluders sending one identical row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if not (args.layers >= 1 and args.n >= 3 and 0 <= args.copies < args.n and args.repeats >= 1):
        ap.error("need --layers >= 1, --n >= 3, 0 <= --copies < --n, --repeats >= 1")
    source = inputs(args.layers, args.n, args.copies)
    names = list(source.names())
    params = sum(int(np.prod(source.shape(nm))) for nm in names)
    soup = DeltaSoup(SoupConfig(aggregator="trimmed-mean"))
    acc, ones = torch.arange(args.n), torch.ones(args.n, dtype=torch.float64)
    times: dict[str, list[float]] = {"with_copies_pass_s": [], "without_s": [], "distance_pass_s": []}
    weights = {}
    sides = [("with_copies_pass_s", True), ("without_s", False)]
    for r in range(args.repeats):  # alternate, each side first every other time: drift and order hit both
        for key, on in (sides if r % 2 == 0 else sides[::-1]):
            sec, weights[key] = run_once(source, copies_pass=on)
            times[key].append(sec)
        t = time.perf_counter()
        soup._distances(source, names, acc, ones, args.n)
        times["distance_pass_s"].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    doc = {
        "benchmark": "trimmed_copies", "command": "python benchmarks/trimmed_copies.py " + " ".join(sys.argv[1:]),
        "params": params, "tensors": len(names), "n": args.n, "copies": args.copies,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "runs_s": times, "best_s": best,
        "ratio_with_over_without": best["with_copies_pass_s"] / best["without_s"],
        "distance_pass_share_of_without": best["distance_pass_s"] / best["without_s"],
        "colluders_weight": {"with_copies_pass": sum(weights["with_copies_pass_s"][args.n - args.copies:]),
                             "without": sum(weights["without_s"][args.n - args.copies:])},
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
