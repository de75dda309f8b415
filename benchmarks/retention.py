"""Quality retention of compressed deltas on the tiny model (prints JSON).

retention = (L_base - L_decoded) / (L_base - L_finetuned): the share of a full fine-tune's held-out loss
gain that survives the codec, for each codec and scale granularity, BitDelta with and without scale
distillation (Liu et al. 2024, arXiv:2402.10193). Target: BitDelta + distillation >= 0.90.

    python benchmarks/retention.py [--steps 150] [--distill-steps 100]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zoo_gym import codec
from zoo_gym.gym_train import (Evaluator, TrainConfig, builtin_examples, default_validation_examples,
                               distill_bitdelta_scales, tiny_model_dir, train)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--distill-steps", type=int, default=100)
    ap.add_argument("--distill-lr", type=float, default=1e-4)
    ap.add_argument("--n-val", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = tiny_model_dir()
    train_ex = builtin_examples("default", shard=0, n_shards=1, n=1024)
    val = default_validation_examples(args.n_val)
    t0 = time.perf_counter()
    res = train(base, train_ex, TrainConfig(method="sft", max_steps=args.steps, learning_rate=args.lr,
                                            batch_size=16), base_sha256="bench", eval_examples=val)
    train_s = time.perf_counter() - t0
    delta = res.delta
    ev = Evaluator(base, val)
    l_base, l_ft = ev.loss(), ev.loss(delta)
    gain = l_base - l_ft

    def retention(decoded) -> float:
        return round((l_base - ev.loss(decoded)) / gain, 4)

    rows = []
    for name, kw in [
        ("fp16", dict(codec="fp16")),
        ("int8/row", dict(codec="int8", group_size=None)),
        ("int4/row", dict(codec="int4", group_size=None)),
        ("int4/g32", dict(codec="int4", group_size=32)),
    ]:
        payload = codec.encode(delta, **kw)
        rows.append({"codec": name, "bytes": len(payload), "retention": retention(codec.decode(payload))})
    calib = train_ex[:64]
    for gname, g in [("tensor", -1), ("row", None), ("g32", 32)]:
        payload = codec.encode(delta, codec="bitdelta", group_size=g)
        plain = retention(codec.decode(payload))
        t1 = time.perf_counter()
        distilled = distill_bitdelta_scales(base, delta, group_size=g, calib_examples=calib,
                                            steps=args.distill_steps, lr=args.distill_lr,
                                            generator=torch.Generator().manual_seed(0))
        dist_s = time.perf_counter() - t1
        payload_d = codec.encode(distilled, codec="bitdelta", group_size=g)
        rows.append({"codec": f"bitdelta/{gname}", "bytes": len(payload), "retention": plain,
                     "retention_distilled": retention(codec.decode(payload_d)),
                     "distill_seconds": round(dist_s, 2)})
    print(json.dumps({
        "benchmark": "retention",
        "model": "tiny",
        "finetune": {"method": "sft", "steps": args.steps, "lr": args.lr, "seconds": round(train_s, 1)},
        "loss_base": round(l_base, 4),
        "loss_finetuned": round(l_ft, 4),
        "distill": {"steps": args.distill_steps, "lr": args.distill_lr, "calib_examples": len(calib)},
        "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
