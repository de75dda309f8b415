"""Benchmark: the server's streamed evaluation and scoring passes against the plain whole-model ones, with the
layer reader thread on and off (zoo_gym/evaluation/streamed_model.py).

    python benchmarks/streamed_passes.py --size 0.6b --work /tmp/sp-0.6b
    python benchmarks/streamed_passes.py --size 1.7b --work /tmp/sp-1.7b --out benchmarks/results/streamed_passes-1.7b.json
    python benchmarks/streamed_passes.py --size 4b --work /tmp/sp-4b --dtype bfloat16 --baseline-dtype bfloat16

A random bf16 Qwen3 of the size's dimensions (benchmarks/scale.py's `build_model`). Baseline, as scale.py
measures it: the float32 model loaded whole, one no-grad forward over validation examples 32..127 (the held-out
loss's part without gradient) and one forward + backward over the first 32 (the scoring set); best of two each.
`--baseline-dtype bfloat16`: that model in bf16 instead (at 4B the float32 one does not fit 24 GB).
Streamed, in `--dtype` (the server's `evaluation_dtype`: auto, float32 or bfloat16): the same forward and the
scoring gradient (`PackedScoringSet.gradient`), each in a fresh process, with the reader thread off and on, and
with the checkpoint's file in two states (`--page-cache`): `warm`, read into the page cache first, as the server
evaluates a checkpoint it has just published (written through the page cache for that reason), and `cold`, its
pages dropped first, as a base prepared after a restart. Output: JSON with seconds and the ratios streamed /
baseline (issue 29's targets: forward <= 1.5x, gradient <= 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _batches(model_dir: Path):
    from zoo_gym import gym_train
    from zoo_gym.evaluation.evaluate import load_tokenizer, tokenize_examples
    from zoo_gym.evaluation.packed_batch import pack_shared_prefix

    tok = load_tokenizer(model_dir)
    pad = tok.pad_token_id or 0
    examples = gym_train.default_validation_examples(n=128)
    return tok, pad, tokenize_examples(tok, examples[:32]), pack_shared_prefix(
        tokenize_examples(tok, examples[32:]), pad_id=pad)


def _read_into_page_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def streamed_pass(model_dir: Path, kind: str, prefetch: bool, dtype: str = "auto", cache: str = "cold") -> dict:
    """One streamed pass ('forward' or 'gradient') with the checkpoint's pages dropped (cold) or read in first
    (warm); seconds and layer-load counts."""
    import torch

    from zoo_gym.io.page_cache import drop_file_cache
    from zoo_gym.evaluation.packed_batch import packed_loss_sum
    from zoo_gym.evaluation.packing import PackedScoringSet
    from zoo_gym.evaluation.streamed_model import compute_dtype, load_streamed, stream_of

    _, pad, scoring_pairs, rest = _batches(model_dir)
    model = load_streamed(model_dir)
    stream = stream_of(model)
    stream.prefetch = prefetch
    scoring = PackedScoringSet(model, scoring_pairs, pad_id=pad) if kind == "gradient" else None
    drop_file_cache(model_dir / "model.safetensors")
    if cache == "warm":
        _read_into_page_cache(model_dir / "model.safetensors")
    t0 = time.perf_counter()
    with stream.computing(compute_dtype(dtype)):
        if kind == "forward":
            with torch.no_grad():
                loss, k = packed_loss_sum(model, rest)
            value = float(loss / k)
        else:
            with tempfile.TemporaryDirectory() as spill:  # the server spills the gradient to disk
                gradient = scoring.gradient(spill_dir=Path(spill))
                value = float(gradient.norm)
    return {"seconds": time.perf_counter() - t0, "value": value, "dtype": str(compute_dtype(dtype)),
            "loss": float(loss / k) if kind == "forward" else gradient.base_loss, "loads": stream.loads,
            "loads_read_ahead": stream.loads_read_ahead, "max_layers_in_memory": stream.max_resident}


def baseline(model_dir: Path, dtype: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    best, first = scale.forward_backward_seconds(model_dir, dtype=getattr(torch, dtype))
    return {"dtype": dtype, "forward_backward_s": best, "forward_backward_first_s": first, "forward_s": scale.FORWARD["rest_s"],
            "forward_first_s": scale.FORWARD["rest_first_s"]}


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.6b", help="benchmarks/scale.py's SIZES key (0.6b, 1.7b, 4b)")
    ap.add_argument("--work", type=Path, help="model directory (built once, reused; required)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the streamed passes' dtype (the server's evaluation_dtype)")
    ap.add_argument("--baseline-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the whole model's dtype for the baseline passes")
    ap.add_argument("--page-cache", nargs="+", default=["warm", "cold"], choices=("warm", "cold"),
                    help="the checkpoint's file read into the page cache first (warm: a just-published checkpoint) "
                         "or dropped from it (cold: a base after a restart)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, model_dir = args.child[0], Path(args.child[1])
        result = (baseline(model_dir, args.child[2]) if what == "baseline"
                  else streamed_pass(model_dir, what, args.child[2] == "on", args.child[3], args.child[4]))
        print(json.dumps(result))
        return
    if args.work is None:
        ap.error("--work DIR is required: the model is built there once and reused")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    args.work.mkdir(parents=True, exist_ok=True)
    params = scale.build_model(args.size, args.work)
    report: dict = {"size": args.size, "params": params, "cpu_count": os.cpu_count(), "baseline": _child("baseline", str(args.work), args.baseline_dtype)}
    for cache in args.page_cache:
        for kind in ("forward", "gradient"):
            for prefetch in ("off", "on"):
                r = _child(kind, str(args.work), prefetch, args.dtype, cache)
                base = report["baseline"]["forward_s" if kind == "forward" else "forward_backward_s"]
                key = f"{kind}_{cache}_read_ahead_{prefetch}"
                report[key] = {**r, "over_baseline": r["seconds"] / base}
                print(json.dumps({"pass": key, **report[key]}), flush=True)
            on, off = report[f"{kind}_{cache}_read_ahead_on"], report[f"{kind}_{cache}_read_ahead_off"]
            assert on["value"] == off["value"], f"{kind}: the reader thread changed the result"
            report[f"{kind}_{cache}_read_ahead_speedup"] = off["seconds"] / on["seconds"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
