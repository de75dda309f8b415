"""Benchmark: the trimmed mean's selection kernel (zoo_gym/aggregation/select_kernels.py) against the best simple
implementation, a stable sort of each block's contiguous columns (what the engine ran before), the same inputs.

    python benchmarks/trimmed_select.py            # -> benchmarks/results/trimmed_select.json
    python benchmarks/trimmed_select.py --quick    # smaller shapes, no file written

For each (contributors, coordinates), unweighted and weighted, trim 0.4 (the default) and 0.1, on seeded float32
deltas: the engine's `trimmed_mean` and the baseline (16 MB blocks of columns made contiguous, sorted along the
last dimension with torch's stable sort, the kept values summed in sorted order in float64, kept values counted
per row as the engine's diagnostics do); best of `--repeats` each, with the threads torch has. The two sum the
same kept values in different orders: `differing` counts the coordinates whose float32 results differ (float64
rounding can move a last bit), `max_abs_diff` the largest difference. Ratio: baseline seconds / engine seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from zoo_gym.aggregation.trimmed_mean import trim_count, trimmed_mean  # noqa: E402

SHAPES = ((10, 3_000_000), (100, 300_000), (970, 49_152), (10_000, 4_096))
SORT_BYTES = 16 << 20  # the baseline's block: the values, their copy and int64 order


def baseline(deltas: torch.Tensor, *, beta: float, weights: torch.Tensor | None) -> torch.Tensor:
    """Stable sort of contiguous column blocks, kept values summed in sorted order in float64."""
    n, d = deltas.shape
    k = trim_count(n=n, beta=beta)
    acc = torch.zeros(d, dtype=torch.float64)
    den = None if weights is None else torch.zeros(d, dtype=torch.float64)
    raw = None if weights is None else weights.to(torch.float64)
    kept = torch.zeros(n, dtype=torch.int64)
    step = max(1, SORT_BYTES // (16 * n))
    for c0 in range(0, d, step):
        values, order = deltas[:, c0:c0 + step].T.contiguous().sort(dim=1, stable=True)
        values, order = values[:, k:n - k].T, order[:, k:n - k].T
        kept += torch.bincount(order.flatten(), minlength=n)
        a = acc[c0:c0 + step]
        for row, who in zip(values, order):
            if raw is None:
                a += row
            else:
                kw = raw[who]
                a += kw * row
                den[c0:c0 + step] += kw
    return (acc / (n - 2 * k) if den is None else acc / den).to(deltas.dtype)


def _best(fn, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "trimmed_select.json")
    args = ap.parse_args(argv)
    shapes = tuple((n, c // 10) for n, c in SHAPES) if args.quick else SHAPES
    doc: dict = {"benchmark": "trimmed_select", "machine": {"python": platform.python_version(),
                 "torch": torch.__version__, "threads": torch.get_num_threads()}, "cases": []}
    for n, c in shapes:
        x = torch.randn(n, c, generator=torch.Generator().manual_seed(n))
        w = torch.rand(n, generator=torch.Generator().manual_seed(c)) + 0.5
        for beta in (0.4, 0.1):
            for weights in (None, w):
                eng_s, eng = _best(lambda: trimmed_mean(x, beta=beta, weights=weights).aggregate, args.repeats)
                base_s, base = _best(lambda: baseline(x, beta=beta, weights=weights), args.repeats)
                case = {"contributors": n, "coordinates": c, "beta": beta, "weighted": weights is not None,
                        "engine_s": round(eng_s, 3), "baseline_s": round(base_s, 3),
                        "baseline_over_engine": round(base_s / eng_s, 2),
                        "differing": int((eng != base).sum()), "max_abs_diff": float((eng - base).abs().max())}
                doc["cases"].append(case)
                print(json.dumps(case), file=sys.stderr)
    doc["min_baseline_over_engine"] = min(c["baseline_over_engine"] for c in doc["cases"])
    text = json.dumps(doc, indent=2)
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return doc


if __name__ == "__main__":
    main()
