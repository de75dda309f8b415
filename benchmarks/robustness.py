"""Benchmark: the attack suite. Held-out loss after R federated rounds on the tiny model, for every
robust aggregator x attack, against the no-attack run with the same seeds.

    python benchmarks/robustness.py --workers 2   # full: n=10, f=3, R=2 -> results/robustness.{json,png}
    python benchmarks/robustness.py --quick       # smoke check (~3 min): n=5, f=1, mean + multi-krum
    python benchmarks/robustness.py --rounds 3 --steps 12 --out /tmp/r.json   # any knob

Cost: one contributor round is 1.3-2.5 s of one core (8 steps; mostly TRL/PEFT set-up), and the
full grid trains 371 of them (13 in round 1, then one set per each of 46 distinct bases): 8-15
core-minutes, so `--workers 2` (processes of one thread each; same numbers as --workers 1) needs
~5-8 minutes on two idle cores. The committed results ran with --workers 14 on a 16-core machine
(100 s).

Protocol (also written into the JSON under "protocol"):
  * n contributors; contributors 0..n-f-1 are honest, n-f..n-1 Byzantine (f of them). Contributor i
    owns shard i of `builtin_examples("default", n_shards=n)` (reverse a string of digits, a skill
    the tiny base never saw); in round r it draws `steps * batch_size` fresh examples of its shard
    (`seed=r`) and trains a LoRA round with `gym_train.train` (r=8, all linear layers, 8 steps of
    batch 8, lr 1e-2, merged dense delta, one CPU thread) from ITS trajectory's current base.
    Every contributor uses the same training seed, as `gym-client join` does (its TrainConfig
    seed defaults to 0 for everyone): the LoRA init is shared, so honest deltas are comparable
    (cosine ~0.6) rather than near-orthogonal (with a seed per contributor, coordinate-wise
    rules see mostly init noise).
  * A trajectory is one (aggregator, attack) pair run for R rounds from the shipped tiny base.
    Each round: the honest contributors train; the Byzantine ones either craft their deltas from
    the honest deltas of the same round (model poisoning, `benchmarks/attacks.py`; they
    see every honest delta, the strongest threat model) or train on label-flipped data (data
    poisoning: their shard's outputs permuted among its examples, a derangement) and submit that
    delta honestly. No attack: the same n contributors, all honest. `DeltaSoup` aggregates the n
    submissions (no DP, no clipping), the aggregate is added to the base in memory, and the
    held-out loss of the server's validation set (`default_validation_examples(128)`, mean
    completion-token cross-entropy) is recorded.
  * Training is cached by (base tensors' sha256, contributor, poisoned): trajectories whose bases
    are bit-identical share the training work (all of them in round 1); otherwise every
    trajectory's honest contributors really train from its own base. Nothing is approximated.
  * Aggregator settings: byzantine_f = f for krum and multi-krum (m = n - f), trim_beta = 0.3
    (0.2 in --quick), centered-clip tau = the median whole-delta L2 norm of the round's
    submissions (a robust scale the server can compute; 3 iterations from the zero delta).
    Bulyan needs n >= 4f + 3 (15 at f = 3) and is reported as impossible. trust-mean weighs each delta by a
    gate on its cosine with the operator's descent direction: minus the gradient of the loss on 64 examples of
    the task it holds itself (`builtin_examples("default", n=64, seed=4242)`, apart from the held-out set) at
    the trajectory's current base. trust-mean-dp is the mechanism DP runs (the same gate over the fixed
    m = n, every delta clipped to the round's median norm) without its noise: what DP's robustness keeps. Contributions that
    validation refuses (the zero free riders) leave the round; the rule then runs with
    f - refused (they were Byzantine and are gone), recorded per cell as byzantine_f_used.
  * Attack parameters: sign flip -s * honest mean (s = 4, a boosted reversed update: at s = 1
    three attackers only slow FedAvg down); scaling 10 * mean (model replacement); Gaussian
    N(0, (10 * rms)^2) with rms the honest deltas' per-coordinate RMS; ALIE mean - z * std with
    Baruch et al.'s z_max; IPM -0.5 * mean; free riders zero or N(0, rms^2); label flip as above.
  * Targets: robust = final loss <= 1.05 x the same aggregator's no-attack loss, for multi-krum
    and trimmed-mean under every attack; FedAvg broken = under sign flip and scaling its final
    loss is >= 1.25 x its no-attack loss (five times the tolerance). Also reported per cell:
    improvement_lost = (L_attack - L_clean) / (L_base - L_clean), the share of the no-attack
    progress the attack undid (> 1: worse than the untouched base).
Prints the JSON document; writes it (and the PNG heat map) unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from zoo_gym.aggregation import DeltaSoup, NotRobustConfigError, SoupConfig
from zoo_gym.aggregation.bulyan import check_bulyan_config
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.gym_train import (Evaluator, TrainConfig, builtin_examples,
                               default_validation_examples, tiny_model_dir, train)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repo root
from benchmarks import attacks  # noqa: E402

ATTACKS = ("none", "sign_flip", "scaling", "gaussian", "alie", "ipm", "free_rider_zero",
           "free_rider_random", "label_flip")
AGGREGATORS = ("mean", "multi-krum", "trimmed-mean", "median", "krum", "geometric-median",
               "centered-clip", "trust-mean", "trust-mean-dp")
# trust-mean-dp: the mechanism DP runs (trust weights over the fixed m = n, every delta clipped to the round's
# median norm) with its noise left out, so the cell shows what the weighting and clip keep against each attack
DP_PATH = {"trust-mean-dp": "trust-mean"}
TARGET_ROBUST = ("multi-krum", "trimmed-mean")
TARGET_BROKEN = ("sign_flip", "scaling")
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class BenchConfigError(ValueError):
    """A BenchConfig field cannot work; the message names the field."""


@dataclass
class BenchConfig:
    n: int = 10                      # contributors per round
    f: int = 3                       # Byzantine among them
    rounds: int = 2                  # R
    steps: int = 8                   # optimizer steps per contributor round
    batch_size: int = 8
    learning_rate: float = 1e-2
    warmup_steps: int = 2
    trim_beta: float = 0.3
    sign_flip_scale: float = 4.0
    scaling_boost: float = 10.0
    gaussian_sigma_rms: float = 10.0  # Gaussian attack std in units of the honest per-coordinate RMS
    ipm_epsilon: float = 0.5
    validation_examples: int = 128
    tolerance: float = 0.05          # robust target: loss ratio <= 1 + tolerance
    broken_ratio: float = 1.25       # FedAvg broken: loss ratio to its no-attack run >= this
    seed: int = 0
    aggregators: tuple[str, ...] = AGGREGATORS
    attacks: tuple[str, ...] = ATTACKS

    def __post_init__(self) -> None:
        if self.f < 1 or self.n < 2 * self.f + 1:
            raise BenchConfigError(f"`f` must be >= 1 and `n` >= 2f + 1 (an honest majority), got "
                                   f"n={self.n}, f={self.f}")
        for name in ("rounds", "steps", "batch_size", "validation_examples"):
            if getattr(self, name) < 1:
                raise BenchConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.trim_beta < 0.5:
            raise BenchConfigError(f"`trim_beta` must be in [0, 0.5), got {self.trim_beta}")
        if not (self.learning_rate > 0 and self.tolerance > 0 and self.broken_ratio > 1):
            raise BenchConfigError("`learning_rate` and `tolerance` must be > 0, `broken_ratio` > 1")
        bad = [a for a in self.aggregators if a not in AGGREGATORS]
        if bad or not self.aggregators:
            raise BenchConfigError(f"`aggregators` must be a non-empty subset of {AGGREGATORS}, got {bad}")
        if "none" not in self.attacks or any(a not in ATTACKS for a in self.attacks):
            raise BenchConfigError(f"`attacks` must include 'none' and be a subset of {ATTACKS}")


QUICK = dict(n=5, f=1, rounds=2, steps=4, trim_beta=0.2, validation_examples=64,
             aggregators=("mean", "multi-krum"))


@dataclass
class Trajectory:
    aggregator: str
    attack: str
    cum: dict[str, torch.Tensor] = field(default_factory=dict)  # sum of published aggregates
    losses: list[float] = field(default_factory=list)           # held-out loss after each round
    byzantine_weight: list[float] = field(default_factory=list)  # attackers' weight in the aggregate
    f_used: list[int] = field(default_factory=list)
    error: str | None = None


# ---- bases ------------------------------------------------------------------------------------
def tensor_key(cum: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(cum):
        h.update(name.encode())
        h.update(cum[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def write_base(base0: dict[str, torch.Tensor], cum: dict[str, torch.Tensor],
               out: pathlib.Path) -> str:
    """A Hugging Face dir with weights base0 + cum; returns the safetensors file's sha256."""
    from safetensors.torch import save_file

    shutil.copytree(tiny_model_dir(), out, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: (v + cum[k] if k in cum else v).contiguous() for k, v in base0.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


# ---- contributors -----------------------------------------------------------------------------
def label_flip(examples: list[dict], *, generator: torch.Generator) -> list[dict]:
    """Each example gets another example's output: a cyclic shift along a random order."""
    order = torch.randperm(len(examples), generator=generator).tolist()
    out = [dict(ex) for ex in examples]
    for j, i in enumerate(order):
        out[i]["output"] = examples[order[(j + 1) % len(order)]]["output"]
    return out


def contributor_delta(base_dir: pathlib.Path, base_sha: str, *, contributor: int, round_index: int,
                      poisoned: bool, cfg: BenchConfig) -> dict[str, torch.Tensor]:
    examples = builtin_examples("default", shard=contributor, n_shards=cfg.n,
                                n=cfg.steps * cfg.batch_size, seed=round_index)
    if poisoned:
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + 1000 * round_index + contributor)
        examples = label_flip(examples, generator=gen)
    tc = TrainConfig(method="lora", max_steps=cfg.steps, batch_size=cfg.batch_size,
                     learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                     merged_delta=True, seed=cfg.seed)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its log dicts
        result = train(base_dir, examples, tc, base_sha256=base_sha, eval_examples=[])
    return result.delta


def flatten(deltas: list[dict[str, torch.Tensor]], names: list[str]) -> torch.Tensor:
    return torch.stack([torch.cat([d[k].reshape(-1) for k in names]) for d in deltas])  # (m, d)


def unflatten(row: torch.Tensor, names: list[str], shapes: dict[str, torch.Size]) -> dict:
    out, pos = {}, 0
    for k in names:
        numel = shapes[k].numel()
        out[k] = row[pos:pos + numel].reshape(shapes[k]).clone()
        pos += numel
    return out


def poison(attack: str, honest: torch.Tensor, *, f: int, cfg: BenchConfig,
           generator: torch.Generator) -> torch.Tensor:
    """(f, d) Byzantine deltas crafted from the honest stack (n - f, d)."""
    rms = float(honest.pow(2).mean().sqrt())
    if attack == "sign_flip":
        return attacks.sign_flip(honest, n_byzantine=f, scale=cfg.sign_flip_scale)
    if attack == "scaling":
        return attacks.scaling(honest, n_byzantine=f, boost=cfg.scaling_boost)
    if attack == "gaussian":
        return attacks.gaussian(honest, n_byzantine=f, sigma=cfg.gaussian_sigma_rms * rms,
                                generator=generator)
    if attack == "alie":
        return attacks.alie(honest, n_byzantine=f)
    if attack == "ipm":
        return attacks.ipm(honest, n_byzantine=f, epsilon=cfg.ipm_epsilon)
    if attack == "free_rider_zero":
        return attacks.free_rider_zero(honest, n_byzantine=f)
    if attack == "free_rider_random":
        return attacks.free_rider_random(honest, n_byzantine=f, generator=generator)
    raise ValueError(f"{attack!r} is not a model-poisoning attack")


# ---- one round of one trajectory ---------------------------------------------------------------
def aggregate(stack: torch.Tensor, *, aggregator: str, cfg: BenchConfig, names: list[str],
              shapes: dict[str, torch.Size], reference: dict[str, torch.Tensor] | None = None
              ) -> tuple[dict[str, torch.Tensor], float, int]:
    """DeltaSoup over the (n, d) submissions; returns (aggregate, Byzantine weight, f used). `reference`: the
    operator's descent direction, for trust-mean."""
    n = stack.shape[0]
    ids = [f"c{i}" for i in range(n)]
    deltas = [unflatten(stack[i], names, shapes) for i in range(n)]
    norms = stack.norm(dim=1)  # (n,)
    refused = int((norms == 0).sum() + (~torch.isfinite(stack).all(dim=1)).sum())
    tau = max(float(norms.median()), 1e-12)
    # the DP path: noise 1e-12 x C / n (nothing, in float32) so the fixed-m weighting and the clip run as under DP
    dp = (dict(dp_noise_multiplier=1e-12, dp_clip=tau, dp_expected_contributors=n, dp_participation="private")
          if aggregator in DP_PATH else {})
    for f_used in (cfg.f, max(cfg.f - refused, 0)):
        soup = DeltaSoup(SoupConfig(aggregator=DP_PATH.get(aggregator, aggregator), byzantine_f=f_used,
                                    trim_beta=cfg.trim_beta, cc_tau=tau, **dp))
        out: dict[str, torch.Tensor] = {}
        try:
            report = soup.run(DictDeltaSource(ids, deltas),
                              lambda name, t: out.__setitem__(name, t.reshape(shapes[name])),
                              generator=torch.Generator().manual_seed(0), reference=reference)
        except NotRobustConfigError:
            if refused == 0 or f_used != cfg.f:
                raise
            continue
        byz = sum(r.weight for r in report.contributors[n - cfg.f:])
        return out, float(byz), f_used
    raise AssertionError("unreachable")


def descent_direction(root: Evaluator, cum: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Minus the gradient of the root set's loss at base + `cum` (the trajectory's current model)."""
    from zoo_gym.rewards import base_gradient

    with root.applied(root.model, cum or None):
        grad = base_gradient(root.model, root._batches).grad  # noqa: SLF001
        return {k: -grad[k].detach().float().clone() for k in names if k in grad}


def _init_worker() -> None:
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _train_job(base_dir: str, sha: str, contributor: int, round_index: int, poisoned: bool,
               cfg_fields: dict) -> tuple[dict, float]:
    """One contributor's training (in a worker process: numpy out, no tensor sharing)."""
    t0 = time.perf_counter()
    delta = contributor_delta(pathlib.Path(base_dir), sha, contributor=contributor,
                              round_index=round_index, poisoned=poisoned,
                              cfg=BenchConfig(**cfg_fields))
    return {k: v.numpy() for k, v in delta.items()}, time.perf_counter() - t0


def run(cfg: BenchConfig, *, workers: int = 1, log=print) -> dict:
    """All trajectories for cfg.rounds rounds; `workers` > 1 trains in that many processes (one
    thread each; the results do not depend on it)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from safetensors.torch import load_file

    _init_worker()
    t_start = time.perf_counter()
    base0 = load_file(str(tiny_model_dir() / "model.safetensors"))
    evaluator = Evaluator(tiny_model_dir(), default_validation_examples(cfg.validation_examples))
    base_loss = evaluator.loss()
    # the operator's root set for trust-mean (FLTrust): examples of the task it holds itself, apart from the
    # held-out set every loss is measured on
    root = Evaluator(tiny_model_dir(), builtin_examples("default", n=64, seed=4242))
    trajs = [Trajectory(a, k) for a in cfg.aggregators for k in cfg.attacks]
    n_honest = cfg.n - cfg.f
    trainings, distinct, train_seconds = 0, [], 0.0
    pool = (ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker)
            if workers > 1 else None)
    with tempfile.TemporaryDirectory(prefix="zoo_gym_robustness_") as tmp, \
            (pool or contextlib.nullcontext()):
        for r in range(cfg.rounds):
            groups: dict[str, list[Trajectory]] = {}
            for t in trajs:
                if t.error is None:
                    groups.setdefault(tensor_key(t.cum), []).append(t)
            distinct.append(len(groups))
            jobs = []  # per group: (base_dir, {(i, poisoned): future or job args})
            for g, members in enumerate(groups.values()):
                base_dir = pathlib.Path(tmp) / f"r{r}_{g}"
                sha = write_base(base0, members[0].cum, base_dir)
                need = {(i, False) for i in range(n_honest)}
                if any(t.attack == "none" for t in members):
                    need |= {(i, False) for i in range(n_honest, cfg.n)}
                if any(t.attack == "label_flip" for t in members):
                    need |= {(i, True) for i in range(n_honest, cfg.n)}
                args = {key: (str(base_dir), sha, key[0], r, key[1], asdict(cfg)) for key in sorted(need)}
                if pool is not None:
                    args = {key: pool.submit(_train_job, *a) for key, a in args.items()}
                jobs.append((base_dir, args))
            for members, (base_dir, args) in zip(groups.values(), jobs):
                trained = {}
                for key, job in args.items():
                    arrays, seconds = job.result() if pool is not None else _train_job(*job)
                    trained[key] = {k: torch.from_numpy(v) for k, v in arrays.items()}
                    trainings += 1
                    train_seconds += seconds
                names = sorted(set().union(*(d.keys() for d in trained.values())))
                shapes = {k: base0[k].shape for k in names}
                for d in trained.values():  # LoRA merges keep only changed weights: fill zeros
                    for k in names:
                        d.setdefault(k, torch.zeros(shapes[k]))
                honest = flatten([trained[(i, False)] for i in range(n_honest)], names)  # (n-f, d)
                reference = (descent_direction(root, members[0].cum, names)
                             if any(t.aggregator in ("trust-mean", "trust-mean-dp") for t in members) else None)
                for t in members:
                    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 31 * r + ATTACKS.index(t.attack))
                    if t.attack == "none":
                        byz = flatten([trained[(i, False)] for i in range(n_honest, cfg.n)], names)
                    elif t.attack == "label_flip":
                        byz = flatten([trained[(i, True)] for i in range(n_honest, cfg.n)], names)
                    else:
                        byz = poison(t.attack, honest, f=cfg.f, cfg=cfg, generator=gen)
                    try:
                        agg, w, f_used = aggregate(torch.cat([honest, byz]), aggregator=t.aggregator,
                                                   cfg=cfg, names=names, shapes=shapes, reference=reference)
                    except NotRobustConfigError as exc:
                        t.error = str(exc)
                        continue
                    for k, v in agg.items():
                        t.cum[k] = t.cum[k] + v if k in t.cum else v
                    t.losses.append(evaluator.loss(t.cum))
                    t.byzantine_weight.append(w if t.attack != "none" else 0.0)
                    t.f_used.append(f_used)
                shutil.rmtree(base_dir)
            log(f"round {r + 1}/{cfg.rounds}: {distinct[-1]} distinct bases, {trainings} trainings "
                f"so far, {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    doc = report(cfg, trajs, base_loss=base_loss, trainings=trainings, distinct=distinct,
                 train_seconds=train_seconds, seconds=time.perf_counter() - t_start)
    doc["machine"]["workers"] = workers
    doc["machine"]["cpu_count"] = os.cpu_count()
    return doc


# ---- the JSON document -------------------------------------------------------------------------
def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


def report(cfg: BenchConfig, trajs: list[Trajectory], *, base_loss: float, trainings: int,
           distinct: list[int], train_seconds: float, seconds: float) -> dict:
    by = {(t.aggregator, t.attack): t for t in trajs}
    clean_fedavg = by.get(("mean", "none"))
    fedavg_loss = clean_fedavg.losses[-1] if clean_fedavg and clean_fedavg.losses else None
    results: dict[str, dict] = {}
    for t in trajs:
        clean = by[(t.aggregator, "none")]
        cell: dict = {"error": t.error} if t.error else {}
        if not t.error:
            final, clean_final = t.losses[-1], clean.losses[-1] if clean.losses else None
            cell.update(final_loss=round(final, 5), losses_per_round=[round(x, 5) for x in t.losses],
                        byzantine_weight_per_round=[round(x, 4) for x in t.byzantine_weight],
                        byzantine_f_used=t.f_used)
            if clean_final is not None:
                cell["ratio_same_aggregator"] = round(final / clean_final, 4)
                cell["ratio_same_aggregator_per_round"] = [
                    round(x / c, 4) for x, c in zip(t.losses, clean.losses)]
                cell["within_tolerance"] = final <= (1 + cfg.tolerance) * clean_final
            if fedavg_loss is not None:
                cell["ratio_fedavg_clean"] = round(final / fedavg_loss, 4)
            if clean_final is not None and base_loss > clean_final:
                cell["improvement_lost"] = round((final - clean_final) / (base_loss - clean_final), 4)
        results.setdefault(t.aggregator, {})[t.attack] = cell
    robust = {a: {k: results[a][k].get("within_tolerance", False) for k in cfg.attacks if k != "none"}
              for a in TARGET_ROBUST if a in results}
    # the same verdict after each round (the target is stated after R; earlier rounds show the path)
    robust_rounds = {a: [all(results[a][k].get("ratio_same_aggregator_per_round", [math.inf] * (r + 1))[r]
                             <= 1 + cfg.tolerance for k in cfg.attacks if k != "none")
                         for r in range(cfg.rounds)] for a in robust}
    worst = {a: max(((results[a][k].get("ratio_same_aggregator", math.inf), k)
                     for k in cfg.attacks if k != "none"), default=(math.nan, None))
             for a in results}
    broken = {}
    if "mean" in results:
        for k in TARGET_BROKEN:
            if k in results["mean"]:
                cell = results["mean"][k]
                ratio = cell.get("ratio_same_aggregator")
                broken[k] = {"ratio": ratio, "improvement_lost": cell.get("improvement_lost"),
                             "broken": ratio is not None and ratio >= cfg.broken_ratio}
    complete = all(a in robust for a in TARGET_ROBUST) and len(broken) == len(TARGET_BROKEN) \
        and set(cfg.attacks) == set(ATTACKS)
    try:
        check_bulyan_config(n=cfg.n, f=cfg.f)
        bulyan = "possible but not run (add it to AGGREGATORS)"
    except NotRobustConfigError as exc:
        bulyan = str(exc)
    return {
        "benchmark": "robustness",
        "command": " ".join(["python", "benchmarks/robustness.py", *sys.argv[1:]]),
        "protocol": {"text": (__doc__ or "").split("Protocol (also written into the JSON under "
                                                   "\"protocol\"):")[1].split("Prints the JSON")[0]
                     .strip(), "config": asdict(cfg)},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    **{m: _version(m) for m in ("transformers", "peft", "trl")},
                    "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
        "seconds": round(seconds, 1),
        "trainings": trainings,
        "train_seconds_sum": round(train_seconds, 1),  # serial cost: what one core would spend
        "seconds_per_training": round(train_seconds / max(trainings, 1), 2),
        "distinct_bases_per_round": distinct,
        "base_loss": round(base_loss, 5),
        "no_attack_fedavg_loss": None if fedavg_loss is None else round(fedavg_loss, 5),
        "not_run": {"bulyan": bulyan},
        "results": results,
        "targets": {
            "robust_within_tolerance": robust,
            "robust_pass": {a: all(v.values()) for a, v in robust.items()},
            "robust_pass_per_round": robust_rounds,
            "worst_attack_per_aggregator": {a: {"attack": k, "ratio": v} for a, (v, k) in worst.items()},
            "fedavg_broken": broken,
            "fedavg_broken_pass": bool(broken) and all(v["broken"] for v in broken.values()),
            "complete_grid": complete,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke check: " + json.dumps(QUICK))
    for name, typ in (("n", int), ("f", int), ("rounds", int), ("steps", int), ("batch-size", int),
                      ("learning-rate", float), ("trim-beta", float), ("seed", int)):
        p.add_argument(f"--{name}", type=typ)
    p.add_argument("--aggregators", nargs="+")
    p.add_argument("--attacks", nargs="+")
    p.add_argument("--out", type=pathlib.Path, help="JSON path (default results/robustness.json; "
                   "--quick writes nothing unless given)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--workers", type=int, default=1, help="training processes (one thread each)")
    args = p.parse_args(argv)
    kw: dict = dict(QUICK) if args.quick else {}
    for name in ("n", "f", "rounds", "steps", "batch_size", "learning_rate", "trim_beta", "seed"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.aggregators:
        kw["aggregators"] = tuple(args.aggregators)
    if args.attacks:
        kw["attacks"] = tuple(args.attacks)
    doc = run(BenchConfig(**kw), workers=args.workers, log=print)
    text = json.dumps(doc, indent=1)
    print(text)
    out = args.out if args.out else (None if args.quick else RESULTS / "robustness.json")
    if out is not None and not args.no_write:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        from robustness_plot import plot

        plot(doc, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
