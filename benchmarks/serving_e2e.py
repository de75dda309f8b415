"""gym-serve's decode path below HTTP (Service: registry, Batcher, MultiVariantModel.generate, sampling),
old tree against new, alternating in child processes (issue 30: throughput unchanged). benchmarks/serving.py
measures the bitdelta kernels alone, which issue 30 did not change. Each child loads the tiny base with
--n-variants random BitDelta variants and decodes --batch concurrent requests (request i: variant i mod N,
every other one seeded, temperature 1) of exactly --tokens tokens (EOS ignored), best of --repeats, one
thread. Reported: tokens per CPU second of the child (load stretches wall time, not CPU) and per wall
second, medians over --rounds, new/old ratios.

Run: PYTHONPATH=. python benchmarks/serving_e2e.py [--old 737083e] [--out benchmarks/results/serving_e2e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def child(args) -> None:
    import asyncio

    import torch

    torch.set_num_threads(1)
    from zoo_gym.serving.batcher import Job
    from zoo_gym.serving.service import ServeOptions, Service

    service = Service(ServeOptions(base=args.base, variants=args.variants, window_ms=50, max_batch=args.batch,
                                   max_tokens=args.tokens, base_name="tiny"))
    service.batcher.eos_ids = set()  # the random tiny model ends most texts in a few tokens: equal work
    service.start()
    names = service.registry.names()
    prompt = service.tokenizer("Once upon a time")["input_ids"]

    async def batch() -> int:
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt=prompt, variant=names[i % len(names)], max_tokens=args.tokens, temperature=1.0,
                    seed=i if i % 2 == 0 else None, loop=loop) for i in range(args.batch)]
        for j in jobs:
            service.batcher.submit(j)
        tokens = 0
        for j in jobs:
            while True:
                kind, _ = await j.out.get()
                if kind != "token":
                    break
                tokens += 1
        return tokens

    asyncio.run(batch())  # warm-up: numba compilation, first allocations
    best = None
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = asyncio.run(batch())
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        run = {"tokens": tokens, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}
        if best is None or run["tokens_per_cpu_s"] > best["tokens_per_cpu_s"]:
            best = run
    service.stop()
    print("@@" + json.dumps(best))


def _prepare(root: pathlib.Path, n: int) -> tuple[pathlib.Path, pathlib.Path]:
    import torch
    from safetensors.torch import load_file

    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.serving.variant import encode_variant, weights_sha256, write_variant

    base = root / "base"
    shutil.copytree(tiny_model_dir(), base)
    tensors = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        delta = {k: torch.randn(t.shape, generator=g) * 0.004 for k, t in tensors.items()}
        write_variant(root / "variants" / f"user{s}.zgd",
                      encode_variant(delta, base_sha256=weights_sha256(base), info={"seed": s}))
    return base, root / "variants"


def _run(tree: pathlib.Path, base, variants, args) -> dict:
    cmd = [sys.executable, str(HERE), "--child", "--base", str(base), "--variants", str(variants),
           "--batch", str(args.batch), "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("@@"))[2:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="737083e", help="a commit from before issue 30's serving changes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-variants", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--base")
    ap.add_argument("--variants")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    new_tree = HERE.parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        old_tree = root / "old"
        old_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(new_tree), "archive", args.old, "zoo_gym"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        base, variants = _prepare(root, args.n_variants)
        runs: dict[str, list] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for name, tree in (("old", old_tree), ("new", new_tree)):
                runs[name].append(_run(tree, base, variants, args))
    head = subprocess.run(["git", "-C", str(new_tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("tokens_per_cpu_s", "tokens_per_s")}
           for k, v in runs.items()}
    doc = {"old": args.old, "new": f"{head} (working tree)", "batch": args.batch, "tokens": args.tokens,
           "variants": args.n_variants, "threads": 1, "rounds": args.rounds, "machine_load_1m": os.getloadavg()[0],
           "cpus": os.cpu_count(), "median": med, "runs": runs,
           "new_over_old_cpu": med["new"]["tokens_per_cpu_s"] / med["old"]["tokens_per_cpu_s"],
           "new_over_old_wall": med["new"]["tokens_per_s"] / med["old"]["tokens_per_s"]}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
