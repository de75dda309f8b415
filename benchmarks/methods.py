"""The training catalog, measured: every stage, fine-tuning type and optimizer a contributor can pick (JSON).

Each case trains a few steps in its own process (so its peak RSS is its own) through the same
``zoo_gym.gym_train.train`` the client runs, on the built-in tiny model or a model with Qwen3-0.6B's
dimensions (random weights, bf16 on disk), and reports: seconds per optimizer step (the trainer's
construction and its steps over the step count; model loading and evaluation excluded), peak RSS, the delta's bytes on the
wire (``codec.encode(codec="auto")``, as ``gym-client join`` sends it) and the held-out change of the
stage's own measure (loss for sft, preference margin for the preference stages, reward for RL).
Ratios are against LoRA SFT measured in the same run. Cases whose stage or option this build or machine
does not offer are reported with the one-line reason the client gives, not skipped silently.

    python benchmarks/methods.py --size tiny --steps 4 --out benchmarks/results/methods-tiny.json
    python benchmarks/methods.py --size 0.6b --steps 2 --cases sft+lora,sft+full,grpo+lora,gspo+lora
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BASELINE = "sft+lora"
# name -> TrainConfig overrides (stage and fine-tuning type, then the option the case is about)
CASES: dict[str, dict] = {
    "sft+lora": {"stage": "sft", "finetuning_type": "lora"},
    "sft+full": {"stage": "sft", "finetuning_type": "full"},
    "sft+freeze": {"stage": "sft", "finetuning_type": "freeze"},
    "sft+oft": {"stage": "sft", "finetuning_type": "oft"},
    "sft+dora": {"stage": "sft", "finetuning_type": "lora", "use_dora": True},
    "sft+rslora": {"stage": "sft", "finetuning_type": "lora", "use_rslora": True},
    "sft+pissa": {"stage": "sft", "finetuning_type": "lora", "init_lora_weights": "pissa"},
    "sft+loftq": {"stage": "sft", "finetuning_type": "lora", "init_lora_weights": "loftq"},
    "sft+lora+": {"stage": "sft", "finetuning_type": "lora", "loraplus_lr_ratio": 16.0},
    "sft+lora+neftune": {"stage": "sft", "finetuning_type": "lora", "neftune_noise_alpha": 5.0},
    "sft+full+adamw": {"stage": "sft", "finetuning_type": "full", "optim": "adamw_torch"},
    "sft+full+galore": {"stage": "sft", "finetuning_type": "full", "optim": "galore_adamw"},
    "sft+full+apollo": {"stage": "sft", "finetuning_type": "full", "optim": "apollo_adamw"},
    "sft+full+adam_mini": {"stage": "sft", "finetuning_type": "full", "optim": "adam_mini"},
    "sft+full+muon": {"stage": "sft", "finetuning_type": "full", "optim": "muon"},
    "sft+full+badam": {"stage": "sft", "finetuning_type": "full", "optim": "badam"},
    "dpo+lora": {"stage": "dpo", "finetuning_type": "lora"},
    "dpo+lora+ipo": {"stage": "dpo", "finetuning_type": "lora", "loss_type": "ipo"},
    "dpo+full": {"stage": "dpo", "finetuning_type": "full"},
    "kto+lora": {"stage": "kto", "finetuning_type": "lora"},
    "orpo+lora": {"stage": "orpo", "finetuning_type": "lora"},
    "simpo+lora": {"stage": "simpo", "finetuning_type": "lora"},
    "rloo+lora": {"stage": "rloo", "finetuning_type": "lora"},
    "grpo+lora": {"stage": "grpo", "finetuning_type": "lora"},
    "gspo+lora": {"stage": "gspo", "finetuning_type": "lora"},
    "grpo+full": {"stage": "grpo", "finetuning_type": "full"},
    "ppo+lora": {"stage": "ppo", "finetuning_type": "lora"},
}
# shared by every case: a short round of small batches (RL: 2 prompts x 4 completions)
COMMON = {"batch_size": 8, "warmup_steps": 0, "max_length": 64, "seed": 0, "device": "cpu",
          "num_generations": 4, "max_completion_length": 6, "grpo_eval_prompts": 16}
LEARNING_RATE = {"lora": 5e-3, "full": 5e-4, "freeze": 5e-4, "oft": 5e-3}


def _rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss, which keeps the parent's at fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(meta: dict) -> tuple[str, float | None, float | None]:
    """(name of the stage's held-out measure, before, after) from a round's metadata."""
    for name in ("preference_margin", "reward"):
        if meta.get(f"{name}_before") is not None:
            return name, meta[f"{name}_before"], meta.get(f"{name}_after")
    return "loss", meta.get("loss_before"), meta.get("loss_after")


def worker(spec: dict) -> dict:
    """One case in this process: train, encode, measure."""
    import torch

    from zoo_gym import codec
    from zoo_gym.gym_train import TrainConfig, builtin_examples, builtin_task, train

    torch.set_num_threads(spec["threads"])
    settings = {**COMMON, "max_steps": spec["steps"], **spec["overrides"]}
    settings.setdefault("learning_rate", LEARNING_RATE.get(settings.get("finetuning_type", "lora"), 5e-3))
    try:
        config = TrainConfig(**settings)
    except (TypeError, ValueError) as exc:  # an option this build does not offer: say which and why
        return {"refused": str(exc).splitlines()[0]}
    examples = builtin_examples(builtin_task(config.stage), n=spec["examples"] + 16)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    try:
        result = train(spec["model"], examples[:spec["examples"]], config, base_sha256="bench",
                       eval_examples=examples[spec["examples"]:])
    except (ValueError, NotImplementedError, ImportError, RuntimeError) as exc:
        return {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    wall = time.perf_counter() - t0
    meta = result.metadata
    payload = codec.encode(result.delta, codec="auto")
    measure, before, after = _measure(meta)
    steps = max(1, int(meta.get("steps") or 1))
    return {
        "stage": config.stage, "finetuning_type": config.finetuning_type,
        "seconds_per_step": round(meta["train_seconds"] / steps, 4), "steps": steps, "round_seconds": round(wall, 2),
        "peak_rss_mb": round(_rss_mb(), 1), "rss_before_training_mb": round(rss0, 1),
        "delta_bytes": len(payload), "delta_format": meta.get("delta_format"),
        "measure": measure, "before": before, "after": after,
        "change": None if before is None or after is None else round(after - before, 6),
    }


def run_case(name: str, args, model_dir: Path) -> dict:
    spec = {"overrides": CASES[name], "steps": args.steps, "threads": args.threads, "model": str(model_dir),
            "examples": args.examples}
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def _ratios(results: dict) -> None:
    base = results.get(BASELINE, {})
    if "seconds_per_step" not in base:
        return
    for r in results.values():
        if "seconds_per_step" in r:
            r["vs_lora_sft"] = {k: round(r[k] / base[k], 3) for k in ("seconds_per_step", "peak_rss_mb", "delta_bytes")
                                if base.get(k)}


def claims(results: dict) -> dict:
    """The platform's published claims, answered from this run's figures (or why they cannot be)."""
    def rss(name):
        return results.get(name, {}).get("peak_rss_mb")

    def compare(a, b, what):
        if rss(a) is None or rss(b) is None:
            missing = a if rss(a) is None else b
            why = results.get(missing, {}).get("refused") or results.get(missing, {}).get("error") or "not run"
            return {"claim": what, "measured": None, "why_not": f"{missing}: {why}"}
        return {"claim": what, "measured": f"{a} peak RSS = {rss(a) / rss(b):.2f}x {b}",
                "ratio": round(rss(a) / rss(b), 3)}

    out = {
        "grpo_vs_ppo_memory": compare("grpo+lora", "ppo+lora", "GRPO uses 40-60% less memory than PPO"),
        "gspo_vs_grpo_memory": compare("gspo+lora", "grpo+lora", "GSPO -60%"),
        "unsloth_speed": {"claim": "Unsloth 2-5x faster", "measured": None,
                          "why_not": "needs CUDA; this machine has none"},
    }
    for opt in ("galore", "apollo", "adam_mini", "muon", "badam"):
        out[f"{opt}_vs_adamw_memory"] = compare(f"sft+full+{opt}", "sft+full+adamw",
                                                f"{opt} optimizer memory below AdamW on a full fine-tune")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=("tiny", "0.6b"), default="tiny",
                    help="the shipped tiny model, or Qwen3-0.6B's dimensions with random weights")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per case")
    ap.add_argument("--examples", type=int, default=64, help="training examples per case (+16 held out)")
    ap.add_argument("--cases", help=f"comma-separated case names (default: all {len(CASES)}; {BASELINE} always runs)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per case")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    names = list(CASES) if not args.cases else [BASELINE] + [c for c in args.cases.split(",") if c != BASELINE]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="zoo_gym_methods_") as tmp:
        if args.size == "tiny":
            from zoo_gym.gym_train import tiny_model_dir

            model_dir = tiny_model_dir()
        else:
            from benchmarks.scale import build_model

            model_dir = Path(tmp) / "model"
            build_model(args.size, model_dir)
        results = {}
        for name in names:
            t0 = time.perf_counter()
            results[name] = run_case(name, args, model_dir)
            print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    _ratios(results)
    out = {"benchmark": "methods", "size": args.size, "steps": args.steps, "threads": args.threads,
           "baseline": BASELINE, "common": COMMON, "results": results, "claims": claims(results)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
