"""Benchmark: real weights, real learning. Federated LoRA SFT of the built-in real base (SmolLM2-135M-Instruct)
on two-digit arithmetic, measured in held-out exact match and retention perplexity, with the attacks, the
pay and the published precision checked on the same deltas.

    python benchmarks/learning.py                      # the full run -> results/learning.json (+ .png)
    python benchmarks/learning.py --rounds 1 --steps 4 --eval-n 40 --out /tmp/l.json   # a smoke run
    python benchmarks/learning.py --rounds 1 --parts pay --update   # rerun one part into results/learning.json
    python benchmarks/learning.py --rounds 1 --parts pay --update --pay-uploads DIR  # ... its uploads kept in DIR

Protocol (also in the JSON under "protocol"):
  * Base: `resolve_base("smollm2-135m")` (zoo_gym/gym_train/bases.py). Task: the built-in `arithmetic` family
    ("What is 30 + 86? Answer with only the number."). Held-out: its validation split (never in a shard).
    Retention: the shipped real-text set (`exact_match.retention_texts`, license and design prose).
  * n contributors, non-IID: contributor i holds shard i of n, and keeps 80% additions if i is even, 80%
    subtractions if odd. Round r trains `steps` LoRA steps at lr / (1 + d (r - 1)) (the server's --client-lr-decay
    d, 1 by default here; 0 for the old constant lr) (FFA-LoRA: A frozen at a shared init, as
    `gym-client --lora-freeze-a`; --no-lora-freeze-a for plain LoRA) of `batch` examples from the round's
    checkpoint with `gym_train.train` (what `gym-client join` runs), and its delta goes through the client's
    codec (`codec.encode(..., codec="auto")`: LoRA factors) and back (`codec.decode`, as the server reads it).
  * The server's default rule (`SoupConfig()`, or --aggregator) merges the round; the float32 master takes
    server_lr x the aggregate (--server-lr, as `gym-server serve --server-lr`; 1 by default);
    the next round trains from it. Exact match (greedy, the prompt ids TRL trains on) and retention
    perplexity after every round. Baseline ("without the feature"): the same contributor 0 training the same
    number of steps alone, from the base, on its own shard.
  * Attacks (round 1, no extra training): 20% of the n submissions replaced by a crafted delta (sign flip x4,
    ALIE, IPM, scaling x10; benchmarks/attacks.py) built from the honest ones; the default rule merges them;
    the share of the clean round-1 gain in exact match kept (accuracy_gain_share).
  * Pay (round 1): n honest, two with partly wrong labels, one with a third of the data, and free riders (a
    zero delta, a random delta of the honest RMS, a copy of contributor 0). Pay: what a real gym-server pays (its report's scores and method),
    scoring on --pay-scoring (exact-match: the 0-1 loss of greedy answers on its --pay-server-n validation items;
    loss: their completion loss), subsets by --pay-subsets (mean or the round's rule), marginal --pay-marginal.
    Ground truth: each one's leave-one-out gain in exact match on --pay-eval-n items no contributor of the round
    trained on (train split, a prefix of the task's draw as the server's validation set is; the validation split's
    leftover is not: 80% sums against the server's 55%, and contributors specialise by operation), in the round
    the server ran (what it refused left out); a delta's content leaves with its byte copies, a copy owns none.
    Each gain comes with its standard error over questions (the paired difference's). Spearman of pay (and of
    the server's marginals) against the ground truth; the truth's split-half Spearman (gains on its even
    questions against its odd ones) says how much of the ranking is above the questions' noise.
  * Published precision: the final master rounded to bf16 (what a bf16 base publishes) against the float32
    master, in exact match. A float32 base (this one) publishes the master itself.
Prints the JSON document; writes it unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import pathlib
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks import attacks  # noqa: E402
from benchmarks.learning_pay import payload_of, server_pay  # noqa: E402
from zoo_gym import codec  # noqa: E402
from zoo_gym.aggregation import DeltaSoup, SoupConfig  # noqa: E402
from zoo_gym.aggregation.sources import DictDeltaSource  # noqa: E402
from zoo_gym.gym_train import TrainConfig, builtin_examples, train  # noqa: E402
from zoo_gym.gym_train.bases import resolve_base  # noqa: E402
from zoo_gym.server.config import client_lr_scale  # noqa: E402
from zoo_gym.gym_train.exact_match import (exact_match, load_for_eval, perplexity,  # noqa: E402
                                           retention_texts)


@dataclass
class Bench:
    base: str = "smollm2-135m"
    task: str = "arithmetic"
    aggregator: str = ""  # the rule of every merge; "" = the server's default (SoupConfig())
    server_lr: float = 1.0  # each round adds server_lr x the aggregate (gym-server --server-lr)
    client_lr_decay: float = 1.0  # round r trains at lr / (1 + d (r - 1)) (gym-server --client-lr-decay; 0: none)
    contributors: int = 4
    rounds: int = 3
    steps: int = 45
    batch: int = 8
    lr: float = 3e-3
    lora_r: int = 16
    lora_freeze_a: bool = True  # FFA-LoRA (gym-client --lora-freeze-a); plain LoRA: --no-lora-freeze-a
    eval_n: int = 100
    pay_eval_n: int = 2000  # items of the pay part's leave-one-out ground truth (no contributor trained on them)
    pay_server_n: int = 1000  # the pay part's server: validation items (the first of the held-out draw eval_n uses)
    pay_scoring: str = "exact-match"  # ... what it scores on (gym-server --scoring-metric)
    pay_subsets: str = "rule"  # ... how it forms a subset's aggregate (--scoring-subsets)
    pay_marginal: str = "leave_one_out"  # ... its marginal (--scoring-marginal)
    pay_uploads: str = ""  # a folder: the pay round's uploads are read from it when there, else trained and kept
    retention_chunks: int = 12
    skew: float = 0.8
    parts: str = "sft,baseline,attacks,pay,publish,grpo,dpo"
    rl_contributors: int = 3
    grpo_steps: int = 8
    dpo_steps: int = 20
    grpo_lr: float = 1e-4  # RL and preference rounds after SFT move the model gently (TRL's defaults: 1e-6 full)
    dpo_lr: float = 1e-4
    seed: int = 0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- data ---------------------------------------------------------------------------------------
def shard_examples(cfg: Bench, contributor: int, round_index: int) -> list[dict]:
    """Contributor's `steps * batch` examples of the round: its shard, skewed to one operation."""
    need = cfg.steps * cfg.batch
    pool = builtin_examples(cfg.task, shard=contributor, n_shards=cfg.contributors, n=3 * need,
                            seed=1000 * round_index + cfg.seed)
    likes = "+" if contributor % 2 == 0 else "-"
    mine = [e for e in pool if f" {likes} " in e["instruction"]]
    other = [e for e in pool if f" {likes} " not in e["instruction"]]
    k = min(len(mine), round(cfg.skew * need))
    out = mine[:k] + other[:need - k]
    random.Random(f"{contributor}/{round_index}").shuffle(out)
    return out


# ---- model state -------------------------------------------------------------------------------
class Checkpoints:
    """The float32 master as a dict, written as a HF directory for the contributors of a round."""

    def __init__(self, base_dir: pathlib.Path, work: pathlib.Path) -> None:
        from safetensors.torch import load_file

        self.base_dir, self.work = base_dir, work
        self.base = {k: v.float() for k, v in load_file(str(next(base_dir.glob("*.safetensors")))).items()}

    def write(self, state: dict[str, torch.Tensor], name: str) -> pathlib.Path:
        from safetensors.torch import save_file

        out = self.work / name
        if out.exists():
            return out
        shutil.copytree(self.base_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        return out


class Judge:
    """One loaded model whose weights are swapped in for each measurement."""

    def __init__(self, base_dir: pathlib.Path, cfg: Bench) -> None:
        self.model, self.tok = load_for_eval(base_dir)
        self.heldout = builtin_examples(cfg.task, split="validation", n=cfg.eval_n, seed=0)
        self.retention = retention_texts()[:cfg.retention_chunks]
        self.keys = set(self.model.state_dict())
        self._packed: dict[int, tuple] = {}  # id(examples) -> (examples, their PackedScoringSet)

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        sd = {k: v for k, v in state.items() if k in self.keys}
        missing = self.model.load_state_dict(sd, strict=False).missing_keys
        # tied embeddings: lm_head shares embed_tokens, so only it may be missing
        assert all(k.endswith("lm_head.weight") for k in missing), missing

    def accuracy(self, state: dict[str, torch.Tensor], examples: list[dict] | None = None) -> tuple[float, list[str]]:
        self._load(state)
        em = exact_match(self.model, self.tok, self.heldout if examples is None else examples, max_new_tokens=6)
        return em.accuracy, em.answers

    def accuracy_tf(self, state: dict[str, torch.Tensor], examples: list[dict]) -> float:
        """Greedy exact match on `examples` from one packed forward pass (`PackedScoringSet.zero_one_loss`)."""
        return float(self.correct_tf(state, examples).float().mean())

    def correct_tf(self, state: dict[str, torch.Tensor], examples: list[dict]) -> torch.Tensor:
        """(len(examples),) bool: which of `examples` greedy decoding answers exactly (`packed_misses`, one pass)."""
        from zoo_gym.evaluation.evaluate import tokenize_examples
        from zoo_gym.evaluation.packing import PackedScoringSet
        from zoo_gym.evaluation.server_evaluator import through_first

        key = id(examples)
        if key not in self._packed:
            pairs = [(p, through_first(c, self.tok.eos_token_id)) for p, c in tokenize_examples(self.tok, examples)]
            self._packed[key] = (examples, PackedScoringSet(self.model, pairs, pad_id=self.tok.pad_token_id or 0))
        self._load(state)
        return ~self._packed[key][1].misses()

    def measure(self, state: dict[str, torch.Tensor]) -> dict:
        acc, answers = self.accuracy(state)
        ppl = perplexity(self.model, self.tok, self.retention)
        return {"exact_match": acc, "retention_ppl": ppl, "answers_first": answers[:5]}


# ---- contributors and the round ----------------------------------------------------------------
def contributor_upload(ckpt_dir: pathlib.Path, examples: list[dict], cfg: Bench, round_index: int = 1
                       ) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Train as `gym-client join` does in round `round_index` (at the server's scheduled learning rate); the
    payload it uploads (codec auto: LoRA factors) and the delta the server decodes from it."""
    lr = cfg.lr * client_lr_scale(cfg.client_lr_decay, round_index)
    tc = TrainConfig(max_steps=cfg.steps, batch_size=cfg.batch, learning_rate=lr, warmup_steps=2,
                     lora_r=cfg.lora_r, lora_alpha=2.0 * cfg.lora_r, lora_freeze_a=cfg.lora_freeze_a, seed=cfg.seed)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(ckpt_dir, examples, tc, base_sha256="0" * 64, eval_examples=[], progress=False)
    payload = payload_of(result.delta)
    return payload, codec.decode(payload)


def contributor_delta(ckpt_dir: pathlib.Path, examples: list[dict], cfg: Bench, round_index: int = 1
                      ) -> dict[str, torch.Tensor]:
    return contributor_upload(ckpt_dir, examples, cfg, round_index)[1]


RULE: dict = {}  # SoupConfig overrides for every merge (--aggregator); empty: the server's default rule


def aggregate(deltas: list[dict[str, torch.Tensor]], soup: SoupConfig | None = None) -> dict[str, torch.Tensor]:
    names = sorted(deltas[0])
    shapes = {k: deltas[0][k].shape for k in names}
    out: dict[str, torch.Tensor] = {}
    DeltaSoup(soup or SoupConfig(**RULE)).run(DictDeltaSource([f"c{i}" for i in range(len(deltas))], deltas),
                                        lambda name, t: out.__setitem__(name, t.reshape(shapes[name]).clone()),
                                        generator=torch.Generator().manual_seed(0))
    return out


def step(deltas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What a round adds to its base: server_lr x the rule's aggregate (SERVER_LR[0], from --server-lr)."""
    agg = aggregate(deltas)
    return agg if SERVER_LR[0] == 1.0 else {k: v * SERVER_LR[0] for k, v in agg.items()}


SERVER_LR = [1.0]


def plus(state: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v + delta[k].to(v.dtype) if k in delta else v) for k, v in state.items()}


def flat(deltas: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, list[str]]:
    names = sorted(deltas[0])
    return torch.stack([torch.cat([d[k].reshape(-1).float() for k in names]) for d in deltas]), names


def unflat(row: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, pos = {}, 0
    for k in names:
        n = like[k].numel()
        out[k] = row[pos:pos + n].reshape(like[k].shape).clone()
        pos += n
    return out


# ---- parts -------------------------------------------------------------------------------------
def run_sft(cfg: Bench, ck: Checkpoints, judge: Judge) -> tuple[dict, list[dict]]:
    state, rounds, first_deltas = dict(ck.base), [], []
    t0 = time.time()
    before = judge.measure(state)
    log(f"base: exact match {before['exact_match']:.3f}, retention ppl {before['retention_ppl']:.2f}")
    for r in range(1, cfg.rounds + 1):
        ckpt = ck.write(state, f"round{r - 1}")
        deltas, payloads = [], []
        for i in range(cfg.contributors):
            t = time.time()
            payload, delta = contributor_upload(ckpt, shard_examples(cfg, i, r), cfg, r)
            payloads.append(payload)
            deltas.append(delta)
            log(f"round {r}: contributor {i} trained in {time.time() - t:.0f} s")
        if r == 1:
            first_deltas = list(zip(payloads, deltas))
        state = plus(state, step(deltas))
        m = judge.measure(state)
        rounds.append({"round": r, **m, "minutes": (time.time() - t0) / 60})
        log(f"round {r}: exact match {m['exact_match']:.3f}, retention ppl {m['retention_ppl']:.2f}")
    ck.final = state
    return {"before": before, "rounds": rounds, "minutes": (time.time() - t0) / 60}, first_deltas


def run_baseline(cfg: Bench, ck: Checkpoints, judge: Judge) -> dict:
    """Contributor 0 alone: the same steps per round, on its own shard only."""
    state, out = dict(ck.base), []
    for r in range(1, cfg.rounds + 1):
        ckpt = ck.write(state, f"alone{r - 1}") if r > 1 else ck.write(state, "round0")
        state = plus(state, contributor_delta(ckpt, shard_examples(cfg, 0, r), cfg, r))
        acc, _ = judge.accuracy(state)
        out.append({"round": r, "exact_match": acc})
        log(f"alone round {r}: exact match {acc:.3f}")
    return {"rounds": out}


def run_attacks(cfg: Bench, ck: Checkpoints, judge: Judge, uploads: list[tuple], base_acc: float) -> dict:
    deltas = [d for _, d in uploads]
    stack, names = flat(deltas)
    f = max(1, round(0.2 * len(deltas)))
    honest = stack[:len(deltas) - f]
    clean_acc, _ = judge.accuracy(plus(ck.base, step(deltas)))
    crafted = {"sign_flip": attacks.sign_flip(honest, n_byzantine=f, scale=4.0),
               "alie": attacks.alie(honest, n_byzantine=f),
               "ipm": attacks.ipm(honest, n_byzantine=f, epsilon=0.5),
               "scaling": attacks.scaling(honest, n_byzantine=f, boost=10.0)}
    gain = clean_acc - base_acc
    out = {"attackers": f, "of": len(deltas), "clean_exact_match": clean_acc, "attacks": {}}
    for name, bad in crafted.items():
        rows = [unflat(r, deltas[0], names) for r in torch.cat([honest, bad])]
        acc, _ = judge.accuracy(plus(ck.base, step(rows)))
        share = (acc - base_acc) / gain if gain > 0 else float("nan")
        out["attacks"][name] = {"exact_match": acc, "accuracy_gain_share": share}
        log(f"attack {name}: exact match {acc:.3f} (gain share {share:.2f})")
    shares = [a["accuracy_gain_share"] for a in out["attacks"].values()]
    out["min_gain_share"] = min(shares) if shares else float("nan")
    return out


def run_pay(cfg: Bench, ck: Checkpoints, judge: Judge, uploads: list[tuple] | None, work: pathlib.Path) -> dict:
    """Round 1 again, on a real server: the honest uploads, two with partly wrong labels, three free riders
    (read from --pay-uploads when it holds them: `uploads`, round 1's, is then not needed)."""
    uploads, kinds = kept_pay_uploads(cfg, ck, lambda: uploads)
    return pay_against_truth(cfg, ck, judge, uploads, kinds, work, trained=pay_trained_questions(cfg))


def kept_pay_uploads(cfg: Bench, ck: Checkpoints, first) -> tuple[list[tuple], list[str]]:
    """The pay round's (payload, delta) uploads and their kinds: read from `cfg.pay_uploads` when it holds them
    (`i.bin` per upload, `kinds.json`), else made by pay_uploads from round 1's honest uploads (`first()`, called
    only then) and kept there when the directory is given."""
    cache = pathlib.Path(cfg.pay_uploads) if cfg.pay_uploads else None
    if cache is not None and (cache / "kinds.json").exists():
        kinds = json.loads((cache / "kinds.json").read_text())
        payloads = [(cache / f"{i}.bin").read_bytes() for i in range(len(kinds))]
        log(f"pay: {len(kinds)} uploads read from {cache}")
        return [(p, codec.decode(p)) for p in payloads], kinds
    uploads, kinds = pay_uploads(cfg, ck, first())
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for i, (p, _) in enumerate(uploads):
            (cache / f"{i}.bin").write_bytes(p)
        (cache / "kinds.json").write_text(json.dumps(kinds))
    return uploads, kinds


def pay_trained_questions(cfg: Bench) -> set[str]:
    """The questions the pay round's contributors trained on (the ground truth leaves them out)."""
    few = replace(cfg, steps=max(1, cfg.steps // 3))  # pay_uploads' contributor with a third of the data
    trained = {e["instruction"] for i in range(cfg.contributors) for e in shard_examples(cfg, i, 1)}
    trained |= {e["instruction"] for j in range(2) for e in shard_examples(cfg, j, 100 + j)}
    return trained | {e["instruction"] for e in shard_examples(few, 2, 102)}


def truth_questions(cfg: Bench, trained: set[str]) -> list[dict]:
    """The pay ground truth's `pay_eval_n` questions: the first of a draw of the train split that are not in
    `trained`."""
    draw = builtin_examples(cfg.task, split="train", n=cfg.pay_eval_n + len(trained), seed=77)
    return [ex for ex in draw if ex["instruction"] not in trained][:cfg.pay_eval_n]


def pay_uploads(cfg: Bench, ck: Checkpoints, uploads: list[tuple]) -> tuple[list[tuple], list[str]]:
    """The pay round's uploads and their kinds: round 1's honest `uploads`, two trained on partly wrong labels, one
    on a third of the data, and the free riders."""
    from zoo_gym.gym_train.real_tasks import wrong_answer

    ckpt = ck.write(ck.base, "round0")
    kinds = ["honest"] * len(uploads)
    uploads = list(uploads)
    for j, noise in enumerate((0.5, 1.0)):
        exs = shard_examples(cfg, j, 100 + j)
        k = round(noise * len(exs))
        exs = [dict(e, output=wrong_answer(cfg.task, e)) if i < k else e for i, e in enumerate(exs)]
        uploads.append(contributor_upload(ckpt, exs, cfg))
        kinds.append(f"wrong_labels_{int(noise * 100)}pct")
        log(f"pay: contributor with {noise:.0%} wrong labels trained")
    few = replace(cfg, steps=max(1, cfg.steps // 3))  # a third of the data: it helps, less
    uploads.append(contributor_upload(ckpt, shard_examples(few, 2, 102), few))
    kinds.append("honest_third_of_the_data")
    log("pay: contributor with a third of the data trained")
    like = uploads[0][1]
    rms = float(torch.cat([d.reshape(-1) for d in like.values()]).pow(2).mean().sqrt())
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    for kind, delta in (("free_rider_zero", {k: torch.zeros_like(v) for k, v in like.items()}),
                        ("free_rider_random", {k: torch.randn(v.shape, generator=gen) * rms for k, v in like.items()})):
        payload = payload_of(delta)
        uploads.append((payload, codec.decode(payload)))
        kinds.append(kind)
    uploads.append(uploads[0])
    kinds.append("free_rider_copy")
    return uploads, kinds


def pay_against_truth(cfg: Bench, ck: Checkpoints, judge: Judge, uploads: list[tuple], kinds: list[str],
                      work: pathlib.Path, *, trained: set[str]) -> dict:
    """What a real server pays each upload of one round, against each one's leave-one-out gain in that round
    (`trained`: the questions its contributors trained on, which the ground truth leaves out)."""
    t = time.time()
    validation = builtin_examples(cfg.task, split="validation", n=cfg.pay_server_n, seed=0)
    exact = cfg.pay_scoring == "exact-match" or cfg.pay_subsets == "rule"
    flags = {"scoring_metric": cfg.pay_scoring, "scoring_subsets": cfg.pay_subsets,
             "scoring_marginal": cfg.pay_marginal, "scoring_method": "exact" if exact else "first-order",
             "scoring_examples": len(validation), "validation_examples": len(validation)}
    amounts, scores, refused, method = server_pay(ck.base_dir, work / "pay", validation, [p for p, _ in uploads],
                                                  flags=flags)
    server_s = time.time() - t
    log(f"pay: the server's round published in {server_s:.0f} s; amounts {amounts}")
    loo, acc_all, check = leave_one_out(cfg, ck, judge, uploads, kinds, accepted=[r is None for r in refused],
                                        trained=trained)
    riders = [a for a, k in zip(amounts, kinds) if k.startswith("free_rider")]
    se = check.pop("loo_standard_error")
    marginals = [s.get("marginal") for s in scores]
    marginals = [m if isinstance(m, float) and math.isfinite(m) else 0.0 for m in marginals]
    return {"contributors": [{"kind": k, "loo_exact_match_gain": g, "loo_standard_error": e, "paid": a,
                              "score": s.get("score"), "server_marginal": s.get("marginal"),
                              "server_marginal_error": s.get("marginal_error"), "reason": s.get("reason") or r}
                             for k, g, e, a, s, r in zip(kinds, loo, se, amounts, scores, refused)],
            "server_flags": flags, "scoring_method": method, "server_validation_items": len(validation),
            "ground_truth_items": check["truth_items"], "ground_truth_greedy_check": check, "exact_match_all": acc_all,
            "spearman": spearman(loo, [float(a) for a in amounts]), "free_rider_pay_max": max(riders),
            "marginal_spearman": spearman(loo, marginals),
            "server_round_s": server_s, "with_ground_truth_s": time.time() - t}


def leave_one_out(cfg: Bench, ck: Checkpoints, judge: Judge, uploads: list[tuple], kinds: list[str], *,
                  accepted: list[bool], trained: set[str]) -> tuple[list[float], float, dict]:
    """Each submission's leave-one-out gain in exact match on `pay_eval_n` items of the train split that no
    contributor of the round trained on (`trained`), under the default rule, in the round the server ran
    (`accepted`: a refused upload is in no aggregate, its gain 0). They are the first of one draw of the task, as
    the server's validation set is: the same mix of questions. A delta's content leaves with all its byte copies;
    a copy of an earlier submission owns none of it (its gain is 0: removing it alone changes nothing). Exact
    match is taken from one forward pass (`packed_misses`: greedy decoding's answers); `check` compares it with
    generation on 100 items."""
    truth = truth_questions(cfg, trained)
    deltas = [d for _, d in uploads]
    shas = [hashlib.sha256(p).hexdigest() for p, _ in uploads]
    everyone = plus(ck.base, step([d for d, ok in zip(deltas, accepted) if ok]))
    right_all = judge.correct_tf(everyone, truth)
    acc_all = float(right_all.float().mean())
    greedy, _ = judge.accuracy(everyone, truth[:100])
    check = {"truth_items": len(truth), "items": len(truth[:100]), "greedy": greedy, "one_pass": judge.accuracy_tf(everyone, truth[:100])}
    loo, check["loo_standard_error"], halves = [], [], ([], [])
    for i in range(len(deltas)):
        if not accepted[i] or shas[i] in shas[:i]:
            loo.append(0.0)
            check["loo_standard_error"].append(0.0)
            halves[0].append(0.0)
            halves[1].append(0.0)
            continue
        without = plus(ck.base, step([d for d, sha, ok in zip(deltas, shas, accepted) if ok and sha != shas[i]]))
        diff = right_all.float() - judge.correct_tf(without, truth).float()  # per question: +1 it helped, -1 hurt
        loo.append(float(diff.mean()))
        # the paired difference's standard error over questions: how far another draw of them could move the gain
        check["loo_standard_error"].append(float(diff.std() / len(truth) ** 0.5))
        halves[0].append(float(diff[0::2].mean()))
        halves[1].append(float(diff[1::2].mean()))
        log(f"pay: leave-one-out {kinds[i]} {i}: gain {loo[-1]:+.4f} (standard error {check['loo_standard_error'][-1]:.4f})")
    # How far the truth itself is from noise: the gains on the even questions ranked against those on the odd
    # ones. No pay can rank with the truth much better than the truth ranks with another draw of its questions.
    check["split_half_spearman"] = spearman(*halves)
    return loo, acc_all, check


def run_after_sft(cfg: Bench, ck: Checkpoints, judge: Judge, stage: str) -> dict:
    """One round of `stage` from the final SFT checkpoint (rl_contributors, the default rule), against that
    checkpoint itself (the same run without the round). grpo: TRL prompt-only records of the task with the
    built-in exact-answer reward; dpo: the task's pairs (a plausible wrong answer rejected)."""
    from zoo_gym.gym_train.formats import normalise_record
    from zoo_gym.gym_train.tasks import prompt_only_records

    ckpt = ck.write(ck.final, "sft_final")
    before, _ = judge.accuracy(ck.final)
    steps = cfg.grpo_steps if stage == "grpo" else cfg.dpo_steps
    deltas, t0 = [], time.time()
    for i in range(cfg.rl_contributors):
        if stage == "grpo":
            recs = prompt_only_records(cfg.task, shard=i, n_shards=cfg.rl_contributors, n=steps * 2, seed=50)
            exs = [normalise_record(r, where=f"record {j}", allow_text=True) for j, r in enumerate(recs)]
            tc = TrainConfig(stage="grpo", max_steps=steps, batch_size=8, num_generations=4, learning_rate=cfg.grpo_lr,
                             warmup_steps=0, lora_r=cfg.lora_r, lora_alpha=2.0 * cfg.lora_r, seed=cfg.seed)
        else:
            exs = builtin_examples(f"{cfg.task}-pairs", shard=i, n_shards=cfg.rl_contributors, n=steps * cfg.batch,
                                   seed=50)
            tc = TrainConfig(stage="dpo", max_steps=steps, batch_size=cfg.batch, learning_rate=cfg.dpo_lr,
                             warmup_steps=2, lora_r=cfg.lora_r, lora_alpha=2.0 * cfg.lora_r, seed=cfg.seed)
        with contextlib.redirect_stdout(io.StringIO()):
            result = train(ckpt, exs, tc, base_sha256="0" * 64, eval_examples=[], progress=False)
        deltas.append(codec.decode(payload_of(result.delta)))
        log(f"{stage}: contributor {i} trained in {time.time() - t0:.0f} s")
    after, answers = judge.accuracy(plus(ck.final, step(deltas)))
    log(f"{stage}: exact match {before:.3f} -> {after:.3f}")
    return {"exact_match_sft": before, "exact_match_after": after, "steps": steps,
            "learning_rate": tc.learning_rate, "minutes": (time.time() - t0) / 60, "answers_first": answers[:5]}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):  # average ranks of ties
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / den if den else float("nan")


def _finite(x):
    """NaN and infinities as null: the JSON stays standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(Bench()).items():
        if isinstance(default, bool):
            ap.add_argument(f"--{f.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default)
        else:
            ap.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "learning.json")
    ap.add_argument("--update", action="store_true", help="rerun only --parts (e.g. pay) and merge them into --out's "
                    "document: the other parts' figures stay as they were, the targets are recomputed from the "
                    "merged document, and `runs` records which commit and settings gave each part")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    cfg = Bench(**{f: getattr(args, f) for f in asdict(Bench())})
    parts = set(cfg.parts.split(","))
    if cfg.aggregator:
        RULE["aggregator"] = cfg.aggregator
    SERVER_LR[0] = cfg.server_lr
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    base_dir = resolve_base(cfg.base)
    doc: dict = {"benchmark": "learning", "config": asdict(cfg), "rule": SoupConfig(**RULE).aggregator, "machine": {
        "cpu_count": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
        "protocol": __doc__.split("Protocol (also in the JSON under \"protocol\"):\n")[1].split("\nPrints")[0]}
    with tempfile.TemporaryDirectory(prefix="zoo-learning-") as tmp:
        ck = Checkpoints(base_dir, pathlib.Path(tmp))
        judge = Judge(base_dir, cfg)
        if parts == {"pay"} and args.update and cfg.pay_uploads and (pathlib.Path(cfg.pay_uploads) / "kinds.json").exists():
            first = None  # the pay round's uploads are kept: round 1 need not train again
        else:
            doc["sft"], first = run_sft(cfg, ck, judge)
            base_acc = doc["sft"]["before"]["exact_match"]
        if "baseline" in parts:
            doc["alone"] = run_baseline(cfg, ck, judge)
        if "attacks" in parts:
            doc["attacks"] = run_attacks(cfg, ck, judge, first, base_acc)
        if "pay" in parts:
            doc["pay"] = run_pay(cfg, ck, judge, first, pathlib.Path(tmp))
        if "publish" in parts:
            master_acc, _ = judge.accuracy(ck.final)
            bf16_acc, _ = judge.accuracy({k: v.to(torch.bfloat16).float() for k, v in ck.final.items()})
            doc["publish"] = {"master_exact_match": master_acc, "bf16_exact_match": bf16_acc,
                              "float32_base_publishes": "the master itself"}
            log(f"publish: master {master_acc:.3f}, bf16 {bf16_acc:.3f}")
        for stage in ("grpo", "dpo"):
            if stage in parts:
                try:
                    doc[stage] = run_after_sft(cfg, ck, judge, stage)
                except Exception as exc:  # noqa: BLE001 - recorded: the other parts' figures still stand
                    doc[stage] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"{stage}: failed: {exc}")
    doc["minutes_total"] = (time.time() - t0) / 60
    run = {"parts": sorted(parts & set(PARTS)), "commit": _commit(), "finished": time.strftime("%Y-%m-%d %H:%M"),
           "minutes": doc["minutes_total"], "config": asdict(cfg)}
    if args.update:
        doc = merged(json.loads(args.out.read_text()), doc, parts)
        doc["runs"] = [*doc.get("runs", []), run]
    else:
        doc["runs"] = [run]
    targets(doc)
    text = json.dumps(_finite(doc), indent=2)
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return doc


PARTS = ("sft", "baseline", "attacks", "pay", "publish", "grpo", "dpo")
_SECTION = {"baseline": "alone"}  # the part's section of the document, where its name differs


def merged(old: dict, new: dict, parts: set[str]) -> dict:
    """`old` with the sections of the parts run now taken from `new` (--update)."""
    out = dict(old)
    for part in parts & set(PARTS):
        section = _SECTION.get(part, part)
        if section in new:
            out[section] = new[section]
    return out


def emit(doc: dict, out: pathlib.Path | None) -> dict:
    """An offline pay check's JSON (learning_pay_metric.py, learning_pay_loss_gate.py) with the commit and the
    minutes since `doc["started"]`, printed and, with `out`, written there."""
    doc = {**{k: v for k, v in doc.items() if k != "started"}, "commit": _commit(),
           "minutes": (time.time() - doc["started"]) / 60}
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
    return doc


def _commit() -> str | None:
    import subprocess

    got = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return got.stdout.strip() or None


def targets(doc: dict) -> None:
    """The issue's targets from the document's sections (after a merge, from the merged ones)."""
    sft = doc["sft"]
    base_acc = sft["before"]["exact_match"]
    last = sft["rounds"][-1]
    doc["targets"] = {
        "exact_match_before": base_acc,
        "exact_match_after": last["exact_match"],
        "rounds": len(sft["rounds"]),
        "minutes": sft["minutes"],
        "retention_ppl_change": last["retention_ppl"] / sft["before"]["retention_ppl"] - 1,
        "attack_gain_share": doc.get("attacks", {}).get("min_gain_share"),
        "pay_spearman": doc.get("pay", {}).get("spearman"),
        "free_rider_pay_max": doc.get("pay", {}).get("free_rider_pay_max"),
        "published_minus_master_accuracy": (doc["publish"]["bf16_exact_match"] - doc["publish"]["master_exact_match"]
                                            if "publish" in doc else None),
    }
    t = doc["targets"]
    doc["targets"]["met"] = {
        "exact_match_60_in_3_rounds": t["exact_match_after"] >= 0.6 and t["rounds"] <= 3,
        "retention_within_10pct": t["retention_ppl_change"] <= 0.10,
        "within_30_minutes": t["minutes"] <= 30,
        "attack_gain_share_90": t["attack_gain_share"] is not None and t["attack_gain_share"] >= 0.9 - 1e-9,  # 0.36 / 0.40 is 0.8999... in floats
        "pay_spearman_0.7": t["pay_spearman"] is not None and t["pay_spearman"] >= 0.7,
        "free_riders_paid_0": t["free_rider_pay_max"] == 0,
        "published_within_1_point": t["published_minus_master_accuracy"] is not None
        and abs(t["published_minus_master_accuracy"]) <= 0.01,
    }


if __name__ == "__main__":
    main()
