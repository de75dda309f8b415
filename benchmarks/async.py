"""Benchmark: synchronous rounds against asynchronous buffered ones (FedBuff) on the tiny model, with
stragglers, dropouts and Byzantine contributors. Training is real, the clock is simulated.

    python benchmarks/async.py --workers 2 --seeds 0 1 2   # full, headline over 3 seeds -> results/async.{json,png}
    python benchmarks/async.py --quick       # smoke run (< 2 min once the tiny model is cached)

Protocol (also written into the JSON under "protocol"):
  * n = 20 contributors. Contributor i's compute time for one local run is t_i x exp(jitter x N(0,1))
    (jitter 0.1, a fresh draw per run), with t_i log-normal: t_i = exp(sigma z_i) at the normal
    quantiles z_i = Phi^-1((i + 0.5) / n), scaled so that t_0 = 1 (fastest) and t_19 = 10 (slowest):
    a 10x spread. Each local run is lost with probability 0.1 (the contributor drops out for that
    run's duration: it neither submits nor counts as compute). Draws are seeded per (contributor,
    run index), so every rule sees the same clock.
  * A local run is `gym_train.train` (LoRA r=8 on all linear layers, `steps` steps of batch 8,
    lr 1e-2, merged dense delta, one CPU thread, training seed 0 for everyone as `gym-client join`
    does; 8 steps by default) on `steps x 8` examples of the contributor's own disjoint shard of
    `builtin_examples("default", n_shards=n)`, drawn with a seed taken from the base's sha256. So a
    delta is a function of (base sha256, contributor) and is cached on disk under that key (plus a
    hash of the training settings): reruns, and runs whose bases coincide (every run's first
    deltas are trained on the shipped base), train nothing twice. So, as with the real client, a
    second run on the same base would give the same delta again: `same_base` says what a contributor
    does when no version was published since its last run began: "wait" for the next one (the
    default, as `gym-client join` does: one delta per contributor per version), "retrain" (the
    client before; its copy lands in the next buffer as a stale delta and repeats the step) or
    "fresh" (a new draw of its shard, seed + draw << 32, cached under the draw too).
  * Sync: round r waits for every contributor that did not drop out this round; it lasts as long
    as its slowest present contributor. The present contributors' deltas are merged with DeltaSoup
    (the server's aggregation code, in process) and the next version is published. `rounds` rounds.
  * Async (FedBuff, Nguyen et al. 2022; the same rule as zoo_gym/server/rounds/async_rounds.py): each
    contributor fetches the newest version when it starts a local run and submits when done (one
    delta per contributor per buffer: a second waits for the flush, as the client does). Its
    staleness s is the number of versions published since its base; s > max_staleness is refused
    and its compute counted as wasted. Every K = buffer_size accepted deltas the buffer is merged
    with w_i = (1 + s_i)^-a (FedAsync's polynomial weight, a = staleness_exponent) as the server
    does (async_rounds.staleness_applied): the mean over the K deltas as submitted with aggregation
    weights w_i, every robust rule over the rows w_i x delta_i (it selects and trims on what it
    averages); f counted per buffer. The next
    version is base + server_lr x step_scale x aggregate: by default (staleness_normalize) the
    staleness-weighted average, else FedBuff's sum / K. When the
    rule cannot run on the buffer (validation refused too many rows for Krum's n >= 2f + 3), the
    buffer stays open for the next accepted delta, as the server reopens a round. Async runs until
    `async_horizon` x the sync run's simulated time. The async settings are what `gym-server serve
    --mode async --buffer-size 10 --max-staleness 6` runs with its defaults (a, server lr, scale);
    K and S are the federation's choice (the server's defaults, K = 3 and S = 4, suit a handful of
    contributors): the JSON's "server_flags" gives each rule's full command line.
  * Byzantine (30%: 6 of 20, contributors spread across the speed range): they follow their
    clock like everyone but submit crafted deltas, computed when the round or buffer closes from
    the honest deltas in it (the strongest threat model: they see every honest delta). Sign flip
    -4 x honest mean, scaling 10 x honest mean, ALIE mean - z x std (Baruch et al.'s z for n = 20,
    f = 6). In async they also claim the newest base, so their rows always get weight 1 and are
    never refused as stale.
  * Rules: mean (FedAvg), trimmed-mean (trim_beta 0.4: at n = 18 it trims 7 per side, at K = 10,
    4), multi-krum (byzantine_f = 6 in sync rounds, 3 per buffer of 10; per buffer it averages
    m = K // 2 = 5, so attackers are never forced into its choice while at most half the buffer:
    f = 3 is their average share, not a bound, and n - f = 7 took 1-2 of 4 whenever a buffer held 4),
    median if asked; the
    SoupConfig defaults otherwise (max_norm_ratio 10: validation refuses a delta longer than 10 x
    the buffer's median norm before any rule runs). mean-unchecked is the mean with that norm check
    off: the rule alone. Each attack's rows refused by validation are counted per publish. Held-out loss: `gym_train.Evaluator` on
    `default_validation_examples(validation_examples)` (mean completion-token cross-entropy), after
    every publish.
  * Measured: simulated time until async's held-out loss is <= the sync run's final loss (same
    rule), as a share of sync's time; each run's final loss; wasted compute: sync, the share of
    present contributors' time spent waiting for the round's slowest; async, the time contributors
    spent holding a finished delta while the buffer had their previous one, plus the compute of
    deltas refused as stale, as a share of finished runs' compute plus that waiting (with
    same_base="wait", idling for a new version counts as waiting too). Targets: time share <= 0.5,
    async waste <= 10%, every robust rule under every attack in async ends within 5% of its own clean
    async loss, and the plain mean (mean-unchecked when run, else mean) under sign flip and under
    scaling is >= 1.25x its clean loss (visibly broken).
  * Seeds: --seeds runs the whole protocol once per seed (the seed draws the clock: compute-time
    jitter and dropouts; every seed trains its own deltas) and reports each target as mean, standard
    deviation, min, max and per-seed values under "headline"; a seed whose async run never reached
    sync's final loss within the horizon counts as not reached (mean_lower_bound takes the horizon).
Prints the JSON document; writes it and the PNG unless --no-write (--quick writes only with --out).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
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
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist

import torch

from zoo_gym.aggregation import DeltaSoup, NotRobustConfigError, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.gym_train import (Evaluator, TrainConfig, builtin_examples,
                               default_validation_examples, tiny_model_dir, train)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repo root
from benchmarks import attacks  # noqa: E402

RULES = ("mean", "trimmed-mean", "multi-krum", "median", "mean-unchecked")  # last: mean, norm check off
ATTACKS = ("none", "sign_flip", "alie", "scaling")
# What a contributor does when its next run would start on the base its last run trained on (no version
# published since): "retrain" the same examples with the same seed (an identical delta, submitted again),
# "fresh": train on a fresh draw of its shard (stochastic local SGD, as FedBuff's clients), "wait" idle
# for the next version.
SAME_BASE = ("retrain", "fresh", "wait")
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEFAULT_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) \
    / "zoo_gym" / "async-bench"


class BenchConfigError(ValueError):
    """A BenchConfig field cannot work; the message names the field."""


@dataclass
class BenchConfig:
    n: int = 20                      # contributors
    f: int = 6                       # Byzantine among them (attack runs)
    speed_span: float = 10.0         # slowest / fastest compute time
    jitter: float = 0.1              # per-run log-normal noise on the compute time
    dropout: float = 0.1             # probability that a local run is lost
    rounds: int = 2                  # sync rounds
    buffer_size: int = 10            # K
    max_staleness: int = 6           # S
    staleness_exponent: float = 3.0  # a in (1 + s)^-a (FedBuff's 0.5, a = 1 and a = 2 were slower here: README)
    server_lr: float = 1.0           # eta
    staleness_normalize: bool = True  # x K / sum of the buffer's w(s_i): the staleness-weighted average
    async_horizon: float = 0.75      # async runs for this share of the sync run's simulated time
    max_versions: int = 12           # and publishes at most this many versions
    same_base: str = "wait"          # a run starting on the base one last trained on: see SAME_BASE
    steps: int = 8                   # optimizer steps per local run
    batch_size: int = 8
    learning_rate: float = 1e-2
    warmup_steps: int = 2
    trim_beta: float = 0.4
    sync_f: int = 6                  # byzantine_f of multi-krum in a sync round
    buffer_f: int = 3                # byzantine_f of multi-krum per async buffer
    buffer_multi_krum_m: int | None = None  # multi-krum's m per async buffer (None: K // 2; K - f is m's default)
    staleness_applied: str | None = None  # "rows" / "weights" for every rule (exploration); None: the server's choice
    sign_flip_scale: float = 4.0
    scaling_boost: float = 10.0
    validation_examples: int = 128
    tolerance: float = 0.05          # robust: loss <= (1 + tolerance) x own clean async loss
    broken_ratio: float = 1.25       # mean broken: loss >= this x its clean async loss
    time_target: float = 0.5
    waste_target: float = 0.10
    seed: int = 0
    rules: tuple[str, ...] = ("mean", "trimmed-mean", "multi-krum", "mean-unchecked")
    attacks: tuple[str, ...] = ATTACKS
    sync_attacks: bool = False       # also run sync rounds under every attack
    speeds: tuple[float, ...] | None = None  # explicit base compute times (tests); else log-normal
    byzantine: tuple[int, ...] | None = None  # explicit Byzantine ids; else spread over speeds

    def __post_init__(self) -> None:
        for name in ("n", "rounds", "buffer_size", "max_versions", "steps", "batch_size",
                     "validation_examples"):
            if getattr(self, name) < 1:
                raise BenchConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise BenchConfigError(f"`warmup_steps` must be in [0, steps): the learning rate is 0 "
                                   f"during warmup, got {self.warmup_steps} of {self.steps} steps")
        if not 0 <= self.f < self.n / 2:
            raise BenchConfigError(f"`f` must be in [0, n/2), got f={self.f}, n={self.n}")
        if not 0 <= self.dropout < 1 or self.jitter < 0 or self.speed_span < 1:
            raise BenchConfigError("`dropout` must be in [0, 1), `jitter` >= 0, `speed_span` >= 1")
        if self.max_staleness < 0 or self.staleness_exponent < 0 or self.server_lr <= 0:
            raise BenchConfigError("`max_staleness` and `staleness_exponent` must be >= 0, "
                                   "`server_lr` > 0")
        if self.sync_f < 0 or self.buffer_f < 0:
            raise BenchConfigError(f"`sync_f` and `buffer_f` must be >= 0, got {self.sync_f}, {self.buffer_f}")
        if not 0 <= self.trim_beta < 0.5:
            raise BenchConfigError(f"`trim_beta` must be in [0, 0.5), got {self.trim_beta}")
        if self.async_horizon <= 0:
            raise BenchConfigError(f"`async_horizon` must be > 0, got {self.async_horizon}")
        if self.staleness_applied not in (None, "rows", "weights"):
            raise BenchConfigError(f"`staleness_applied` must be rows, weights or None, got {self.staleness_applied!r}")
        if self.same_base not in SAME_BASE:
            raise BenchConfigError(f"`same_base` must be one of {SAME_BASE}, got {self.same_base!r}")
        if not self.rules or any(r not in RULES for r in self.rules):
            raise BenchConfigError(f"`rules` must be a non-empty subset of {RULES}, got {self.rules}")
        if "none" not in self.attacks or any(a not in ATTACKS for a in self.attacks):
            raise BenchConfigError(f"`attacks` must include 'none' and be a subset of {ATTACKS}")
        if self.speeds is not None and (len(self.speeds) != self.n or min(self.speeds) <= 0):
            raise BenchConfigError(f"`speeds` must give n={self.n} positive compute times")
        if self.byzantine is not None and (len(self.byzantine) != self.f
                                           or not set(self.byzantine) <= set(range(self.n))):
            raise BenchConfigError(f"`byzantine` must list f={self.f} distinct ids in [0, n)")


QUICK = dict(n=6, f=1, rounds=1, buffer_size=3, max_staleness=4, buffer_f=0, sync_f=1,
             trim_beta=0.2, steps=2, warmup_steps=1, validation_examples=32, max_versions=4,
             rules=("mean", "trimmed-mean"), attacks=("none", "sign_flip"))


# ---- the simulated clock (pure) -----------------------------------------------------------------
def base_times(cfg: BenchConfig) -> list[float]:
    """(n,) compute time of one local run per contributor: log-normal quantiles, t_0 = 1,
    t_{n-1} = speed_span (contributor 0 is the fastest)."""
    if cfg.speeds is not None:
        return [float(t) for t in cfg.speeds]
    z = [NormalDist().inv_cdf((i + 0.5) / cfg.n) for i in range(cfg.n)]
    if cfg.n == 1:
        return [1.0]
    sigma = math.log(cfg.speed_span) / (z[-1] - z[0])
    return [math.exp(sigma * (zi - z[0])) for zi in z]


def byzantine_ids(cfg: BenchConfig) -> tuple[int, ...]:
    """f ids spread evenly over the speed ranks (none of them the fastest)."""
    if cfg.byzantine is not None:
        return tuple(sorted(cfg.byzantine))
    return tuple(sorted({min(cfg.n - 1, round((j + 0.5) * cfg.n / cfg.f)) for j in range(cfg.f)}))


def local_run(cfg: BenchConfig, times: list[float], contributor: int, run_index: int
              ) -> tuple[float, bool]:
    """(compute time, dropped out) of a contributor's run_index-th local run."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + contributor * 10_007 + run_index)
    noise = float(torch.randn((), generator=gen))
    dropped = float(torch.rand((), generator=gen)) < cfg.dropout
    return times[contributor] * math.exp(cfg.jitter * noise), dropped


@dataclass
class Submission:
    contributor: int
    base: int          # the version it trained on
    staleness: int     # versions published since its base (as claimed to the server)
    start: float
    end: float
    draw: int = 0      # which draw of its shard it trained on (>0: a fresh draw on a base it trained on)


@dataclass
class Publish:
    version: int       # the version this publish creates
    time: float
    submissions: list[Submission]


@dataclass
class Schedule:
    publishes: list[Publish]
    compute_used: float      # contributor time spent on runs that counted
    compute_wasted: float    # waiting (sync; async: held while the buffer had one's delta) + refused
    refused: int = 0
    waiting: float = 0.0     # the waiting part of compute_wasted

    @property
    def waste_share(self) -> float:
        total = self.compute_used + self.compute_wasted
        return self.compute_wasted / total if total > 0 else 0.0


def sync_schedule(cfg: BenchConfig, times: list[float]) -> Schedule:
    """Round r: everyone present trains on version r; the round ends with its slowest member.
    Waiting = the round's length minus one's own compute, for each present contributor."""
    pubs, now, used, waited = [], 0.0, 0.0, 0.0
    for r in range(cfg.rounds):
        runs = [(i, *local_run(cfg, times, i, r)) for i in range(cfg.n)]
        present = [(i, d) for i, d, dropped in runs if not dropped]
        length = max((d for _, d in present), default=0.0)
        used += sum(d for _, d in present)
        waited += sum(length - d for _, d in present)
        pubs.append(Publish(r + 1, now + length,
                            [Submission(i, r, 0, now, now + d) for i, d in present]))
        now += length
    return Schedule(pubs, used, waited, 0, waited)


class AsyncClock:
    """FedBuff's clock, one flush attempt at a time: each contributor fetches the newest version
    when it starts a local run and submits when done; a delta staler than max_staleness is refused
    (its compute wasted). Once the open buffer holds K accepted deltas, `next_buffer` returns it; the
    caller merges and says whether that published (`flushed(True)`) or the rule could not run on it
    (`flushed(False)`: the buffer stays open and takes the next accepted delta too, as the server
    reopens a round). A buffer takes one delta per contributor: one who finishes while the buffer
    holds its previous delta waits, idle, until that buffer flushes, then submits (its staleness
    counted then) and starts its next run, as `gym-client join` does in async mode. With
    same_base="wait" one who would start again on the version it last trained on idles until the next
    version (counted as waiting). `liars` claim
    the newest base (staleness 0). Ties go by contributor id. Stops at simulated time `until` or
    after max_versions publishes."""

    def __init__(self, cfg: BenchConfig, times: list[float], *, until: float,
                 liars: frozenset[int] = frozenset()) -> None:
        self.cfg, self.times, self.until, self.liars = cfg, times, until, liars
        self.version, self.runs_done = 0, [0] * cfg.n
        self.buffer: list[Submission] = []
        self.publishes: list[Publish] = []
        self.used = self.wasted = self.idle = 0.0  # compute merged, refused as stale; time held idle
        self.refused = self.reopened = 0
        self._need = cfg.buffer_size  # accepted deltas the open buffer must hold to be merged
        self.held: list[tuple[int, float, int, float, int]] = []  # (who, start, base, end, draw) waiting to submit
        self.events: list[tuple[float, int, float, int, bool, int]] = []  # (end, who, start, base, dropped, draw)
        self.trained: list[tuple[int, int]] = [(-1, 0)] * cfg.n  # (base, runs finished on it) per contributor
        self.parked: list[tuple[int, float]] = []  # same_base="wait": (who, since) idle until the next version
        self._waiting: tuple[int | None, float] | None = None  # who filled the buffer (to restart), when
        for i in range(cfg.n):
            self._start(i, 0.0)

    def _start(self, i: int, now: float) -> None:
        draw = 0
        base, runs = self.trained[i]
        if base == self.version:  # no version published since its last finished run began
            if self.cfg.same_base == "wait":
                self.parked.append((i, now))
                return
            draw = runs if self.cfg.same_base == "fresh" else 0
        d, dropped = local_run(self.cfg, self.times, i, self.runs_done[i])
        self.runs_done[i] += 1
        heapq.heappush(self.events, (now + d, i, now, self.version, dropped, draw))

    def _finished(self, i: int, base: int) -> None:
        b, runs = self.trained[i]
        self.trained[i] = (base, runs + 1 if b == base else 1)

    def next_buffer(self) -> Publish | None:
        """The buffer to merge next, as the Publish it would make (None: past the horizon)."""
        if self._waiting is not None:
            raise RuntimeError("call flushed() first")
        if len(self.publishes) >= self.cfg.max_versions:
            return None
        if len(self.buffer) >= self._need:  # filled by deltas held through the last flush
            self._waiting = (None, self.buffer[-1].end)
            return Publish(self.version + 1, self.buffer[-1].end, list(self.buffer))
        while self.events:
            end, i, begun, base, dropped, draw = heapq.heappop(self.events)
            if end > self.until:
                self.events.clear()
                return None
            if not dropped:
                self._finished(i, base)
            if not dropped and any(b.contributor == i for b in self.buffer):
                self.held.append((i, begun, base, end, draw))  # one delta per contributor per buffer
                continue
            if not dropped:
                s = 0 if i in self.liars else self.version - base
                if s > self.cfg.max_staleness:
                    self.wasted += end - begun
                    self.refused += 1
                else:
                    self.used += end - begun
                    self.buffer.append(Submission(i, base, s, begun, end, draw))
                    if len(self.buffer) >= self._need:
                        self._waiting = (i, end)
                        return Publish(self.version + 1, end, list(self.buffer))
            self._start(i, end)
        return None

    def flushed(self, published: bool) -> None:
        i, now = self._waiting
        self._waiting = None
        if published:
            self.version += 1
            self.publishes.append(Publish(self.version, now, self.buffer))
            self.buffer = []
            self._need = self.cfg.buffer_size
        else:  # reopened: merged again once one more delta is accepted
            self.reopened += 1
            self._need = len(self.buffer) + 1
        if i is not None:
            self._start(i, now)  # fetches the newest version, after this flush
        if published:
            held, self.held = self.held, []
            for j, begun, base, end, draw in held:  # they submit now, then start their next run
                self.idle += now - end
                s = 0 if j in self.liars else self.version - base
                if s > self.cfg.max_staleness:
                    self.wasted += end - begun
                    self.refused += 1
                else:
                    self.used += end - begun
                    self.buffer.append(Submission(j, base, s, begun, now, draw))
                self._start(j, now)
            parked, self.parked = self.parked, []
            for j, since in parked:  # a new version: they start on it
                self.idle += now - since
                self._start(j, now)

    def schedule(self) -> Schedule:
        return Schedule(self.publishes, self.used, self.wasted + self.idle, self.refused, self.idle)


def async_schedule(cfg: BenchConfig, times: list[float], *, until: float,
                   liars: frozenset[int] = frozenset()) -> Schedule:
    """The clock when every flush publishes (the rule always runs)."""
    clock = AsyncClock(cfg, times, until=until, liars=liars)
    while clock.next_buffer() is not None:
        clock.flushed(True)
    return clock.schedule()


def staleness_weight(staleness: int, *, exponent: float) -> float:
    """w(s) = (1 + s)^-exponent (FedAsync's polynomial; as zoo_gym/server/rounds/async_rounds.py)."""
    return float((1.0 + staleness) ** -exponent)


# ---- real training, cached by (base sha256, contributor) ----------------------------------------
def train_key(cfg: BenchConfig) -> str:
    """Hash of everything besides the base and the contributor that a delta depends on."""
    fields = {k: getattr(cfg, k) for k in ("n", "steps", "batch_size", "learning_rate",
                                           "warmup_steps")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def base_bytes(base0: dict[str, torch.Tensor], cum: dict[str, torch.Tensor]) -> bytes:
    """The safetensors file of base0 + cum (what the server would publish and hash)."""
    from safetensors.torch import save

    state = {k: (v + cum[k] if k in cum else v).contiguous() for k, v in base0.items()}
    return save(state, metadata={"format": "pt"})


def _init_worker() -> None:
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def train_delta(base_dir: str, sha: str, contributor: int, draw: int, cfg_fields: dict, out: str) -> float:
    """One local run of `contributor` on the base in base_dir (its `draw`-th draw of examples on that
    base), saved to `out`; returns seconds."""
    from safetensors.torch import save_file

    cfg = BenchConfig(**cfg_fields)
    t0 = time.perf_counter()
    examples = builtin_examples("default", shard=contributor, n_shards=cfg.n,
                                n=cfg.steps * cfg.batch_size, seed=int(sha[:8], 16) + (draw << 32))
    tc = TrainConfig(method="lora", max_steps=cfg.steps, batch_size=cfg.batch_size,
                     learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                     merged_delta=True, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its log dicts
        result = train(pathlib.Path(base_dir), examples, tc, base_sha256=sha, eval_examples=[])
    tmp = out + f".tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in result.delta.items()}, tmp)
    os.replace(tmp, out)  # atomic: a killed run never leaves half a delta in the cache
    return time.perf_counter() - t0


class DeltaCache:
    """Deltas on disk at cache_dir/<base sha256>-<contributor>-<training settings hash>."""

    def __init__(self, cache_dir: pathlib.Path, cfg: BenchConfig, base0: dict[str, torch.Tensor],
                 *, workers: int) -> None:
        self.dir, self.cfg, self.base0, self.workers = cache_dir, cfg, base0, workers
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = train_key(cfg)
        self.trained = self.hits = 0
        self.train_seconds = 0.0
        self._pool = None

    def path(self, sha: str, contributor: int, draw: int = 0) -> pathlib.Path:
        extra = f"-draw{draw}" if draw else ""
        return self.dir / f"{sha}-{contributor}{extra}-{self.key}.safetensors"

    def ensure(self, needs: dict[tuple[str, int, int], dict[str, torch.Tensor]]) -> None:
        """Train every (sha, contributor, draw) in `needs` (value: the base's cum) not yet on disk."""
        missing = {k: v for k, v in needs.items() if not self.path(*k).exists()}
        self.hits += len(needs) - len(missing)
        if not missing:
            return
        with tempfile.TemporaryDirectory(prefix="zoo_gym_async_") as tmp:
            jobs = []
            for b, sha in enumerate(sorted({sha for sha, *_ in missing})):
                base_dir = pathlib.Path(tmp) / f"b{b}"
                shutil.copytree(tiny_model_dir(), base_dir, ignore=shutil.ignore_patterns("*.safetensors"))
                cum = next(v for (s, *_), v in missing.items() if s == sha)
                (base_dir / "model.safetensors").write_bytes(base_bytes(self.base0, cum))
                jobs += [(str(base_dir), sha, c, draw, asdict(self.cfg), str(self.path(sha, c, draw)))
                         for s, c, draw in sorted(missing) if s == sha]
            if self.workers > 1:
                if self._pool is None:
                    from concurrent.futures import ProcessPoolExecutor
                    from multiprocessing import get_context

                    self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"),
                                                     initializer=_init_worker)
                seconds = [f.result() for f in [self._pool.submit(train_delta, *j) for j in jobs]]
            else:
                seconds = [train_delta(*j) for j in jobs]
        self.trained += len(jobs)
        self.train_seconds += sum(seconds)

    def load(self, sha: str, contributor: int, draw: int = 0) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.path(sha, contributor, draw)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# ---- one trajectory: a mode x rule x attack ------------------------------------------------------
@dataclass
class Trajectory:
    mode: str                  # "sync" | "async"
    rule: str
    attack: str
    schedule: Schedule | None          # sync: fixed in advance
    clock: AsyncClock | None = None    # async: advanced flush by flush
    versions: list[dict[str, torch.Tensor]] = field(default_factory=lambda: [{}])  # cum per version
    shas: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=lambda: [0.0])
    losses: list[float] = field(default_factory=list)
    weights: list[list[float]] = field(default_factory=list)      # staleness weight per row
    byzantine_weight: list[float] = field(default_factory=list)   # attackers' share of the aggregate
    byzantine_refused: list[int] = field(default_factory=list)    # their rows validation refused (norm check)
    reopened: list[str] = field(default_factory=list)             # async flushes the rule refused
    error: str | None = None
    _candidate: Publish | None = None

    @property
    def name(self) -> str:
        return f"{self.mode}/{self.rule}/{self.attack}"

    def pending(self) -> Publish | None:
        """The next publish to attempt (the same one until `resolve` is called)."""
        if self.error:
            return None
        if self.clock is not None:
            if self._candidate is None:
                self._candidate = self.clock.next_buffer()
            return self._candidate
        done = len(self.versions) - 1
        return self.schedule.publishes[done] if done < len(self.schedule.publishes) else None

    def resolve(self, refusal: str | None) -> None:
        """After a merge attempt: async reopens the buffer on a refusal, sync stops."""
        if self.clock is not None:
            self._candidate = None
            self.clock.flushed(refusal is None)
            self.schedule = self.clock.schedule()
            if refusal is not None:
                self.reopened.append(refusal)
        elif refusal is not None:
            self.error = refusal


def server_flags(cfg: BenchConfig, rule: str) -> str:
    """The `gym-server serve` command line whose async rule this benchmark runs for `rule`: K and S always
    (the server's defaults are for a handful of contributors), a, eta and the normalisation only where they
    differ from the server's defaults."""
    from zoo_gym.server.config import ServerConfig

    server = ServerConfig()
    flags = ["gym-server serve --mode async", f"--buffer-size {cfg.buffer_size}",
             f"--max-staleness {cfg.max_staleness}"]
    if cfg.staleness_exponent != server.staleness_exponent:
        flags.append(f"--staleness-exponent {cfg.staleness_exponent:g}")
    if cfg.server_lr != server.server_lr:
        flags.append(f"--server-lr {cfg.server_lr:g}")
    if cfg.staleness_normalize != server.staleness_normalize:
        flags.append("--staleness-normalize" if cfg.staleness_normalize else "--no-staleness-normalize")
    soup = soup_config(cfg, rule, "async")
    flags.append(f"--aggregator {soup.aggregator}")
    if soup.aggregator == "trimmed-mean":
        flags.append(f"--trim-beta {soup.trim_beta:g}")
    if soup.aggregator in ("krum", "multi-krum", "bulyan"):
        flags.append(f"--byzantine-f {soup.byzantine_f}")
    if cfg.buffer_multi_krum_m is not None:  # otherwise the server's own default, K // 2
        flags.append(f"(multi-krum-m = {soup.multi_krum_m} in the config file)")
    if soup.max_norm_ratio is None:
        flags.append("(max-norm-ratio off, in the config file)")
    return " ".join(flags)


def soup_config(cfg: BenchConfig, rule: str, mode: str) -> SoupConfig:
    """The rule's SoupConfig; "mean-unchecked" is the mean with validation's norm check (max_norm_ratio) off,
    to show the rule alone: that check, not the mean, is what refuses boosted (scaling) deltas."""
    if rule == "mean-unchecked":
        return SoupConfig(aggregator="mean", max_norm_ratio=None)
    soup = SoupConfig(aggregator=rule, trim_beta=cfg.trim_beta,
                      byzantine_f=cfg.sync_f if mode == "sync" else cfg.buffer_f,
                      multi_krum_m=cfg.buffer_multi_krum_m if mode == "async" else None)
    if mode == "async":  # the server's m per buffer (K // 2 unless set), as a flush records it
        from zoo_gym.server.rounds import async_rounds

        soup = replace(soup, multi_krum_m=async_rounds.buffer_multi_krum_m(soup, cfg.buffer_size))
    return soup


def craft(attack: str, honest: torch.Tensor, *, n_byzantine: int, cfg: BenchConfig) -> torch.Tensor:
    """(n_byzantine, d) Byzantine rows from the honest raw deltas (m, d) of the same round/buffer."""
    if attack == "sign_flip":
        return attacks.sign_flip(honest, n_byzantine=n_byzantine, scale=cfg.sign_flip_scale)
    if attack == "scaling":
        return attacks.scaling(honest, n_byzantine=n_byzantine, boost=cfg.scaling_boost)
    if attack == "alie":  # z for the whole population (n, f): what the attackers know
        return attacks.alie(honest, n_byzantine=n_byzantine, z=attacks.alie_z(n=cfg.n, n_byzantine=cfg.f))
    raise ValueError(f"unknown attack {attack!r}")


def merge(t: Trajectory, pub: Publish, deltas: list[dict[str, torch.Tensor] | None],
          cfg: BenchConfig, shapes: dict[str, torch.Size]) -> str | None:
    """Publish the next version of `t` from `pub`'s honest `deltas` (None: a Byzantine row, crafted
    here from the honest ones) as the server does (zoo_gym/server/rounds/async_rounds.py): the mean over the deltas
    as submitted with weights w(s_i), a robust rule over the rows w(s_i) x delta_i (`staleness_applied`
    overrides it for exploration); then base + server_lr x step_scale x aggregate."""
    from zoo_gym.server.rounds import async_rounds

    names = sorted(shapes)
    subs = pub.submissions
    rows = [None if d is None else torch.cat([d[k].reshape(-1) if k in d else torch.zeros(shapes[k].numel())
                                              for k in names]) for d in deltas]  # (d,) each
    is_byz = [r is None for r in rows]
    if any(is_byz):
        honest = torch.stack([r for r in rows if r is not None])  # (m, d)
        crafted = iter(craft(t.attack, honest, n_byzantine=sum(is_byz), cfg=cfg))
        rows = [next(crafted) if b else r for r, b in zip(rows, is_byz)]
    w = [staleness_weight(s.staleness, exponent=cfg.staleness_exponent) if t.mode == "async" else 1.0
         for s in subs]
    soup = soup_config(cfg, t.rule, t.mode)
    applied = cfg.staleness_applied or async_rounds.staleness_applied(soup)  # the server records it at close
    as_weights = t.mode == "async" and applied == "weights"
    dicts = []
    for r, wi in zip(rows, w):
        d, pos = {}, 0
        for k in names:
            d[k] = ((1.0 if as_weights else wi) * r[pos:pos + shapes[k].numel()]).reshape(shapes[k])
            pos += shapes[k].numel()
        dicts.append(d)
    out: dict[str, torch.Tensor] = {}
    try:
        report = DeltaSoup(soup).run(
            DictDeltaSource([f"c{s.contributor}" for s in subs], dicts),
            lambda name, agg: out.__setitem__(name, agg.reshape(shapes[name])),
            weights=torch.tensor(w, dtype=torch.float64) if as_weights else None)
    except NotRobustConfigError as exc:  # the server reopens the round and waits for more
        return f"publish {pub.version} with {len(subs)} deltas at t={pub.time:.3f}: {exc}"
    lr = cfg.server_lr if t.mode == "async" else 1.0
    if t.mode == "async":  # the server's step_scale (async_rounds.py)
        lr *= async_rounds.step_scale(w, normalize=cfg.staleness_normalize, applied=applied)
    prev = t.versions[-1]
    t.versions.append({k: prev[k] + lr * v if k in prev else lr * v for k, v in out.items()})
    t.times.append(pub.time)
    t.weights.append(w)
    t.byzantine_weight.append(sum(r.weight for r, b in zip(report.contributors, is_byz) if b))
    t.byzantine_refused.append(sum(not r.accepted for r, b in zip(report.contributors, is_byz) if b))
    return None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run(cfg: BenchConfig, *, workers: int = 1, cache_dir: pathlib.Path = DEFAULT_CACHE,
        log=print) -> tuple[dict, list[Trajectory]]:
    """Every trajectory, publish by publish in lockstep (so one batch of training serves all of
    them); returns the JSON document and the trajectories (with every version's weights)."""
    from safetensors.torch import load_file

    _init_worker()
    t_start = time.perf_counter()
    base0 = load_file(str(tiny_model_dir() / "model.safetensors"))
    evaluator = Evaluator(tiny_model_dir(), default_validation_examples(cfg.validation_examples))
    base_loss = evaluator.loss()
    times, byz = base_times(cfg), byzantine_ids(cfg)
    sync = sync_schedule(cfg, times)
    t_sync = sync.publishes[-1].time
    horizon = cfg.async_horizon * t_sync
    attacks_run = [a for a in cfg.attacks if a != "none"] if cfg.f else []
    trajs = [Trajectory("sync", r, "none", sync) for r in cfg.rules]
    if cfg.sync_attacks:
        trajs += [Trajectory("sync", r, a, sync) for r in cfg.rules for a in attacks_run]
    trajs += [Trajectory("async", r, a, None, AsyncClock(
        cfg, times, until=horizon, liars=frozenset(byz) if a != "none" else frozenset()))
        for r in cfg.rules for a in ("none", *attacks_run)]
    sha0 = _sha(base_bytes(base0, {}))
    for t in trajs:
        t.shas, t.losses = [sha0], [base_loss]
    cache = DeltaCache(cache_dir, cfg, base0, workers=workers)
    shapes: dict[str, torch.Size] = {}
    try:
        step = 0
        while active := [(t, p) for t in trajs if (p := t.pending()) is not None]:
            step += 1
            needs = {}
            for t, pub in active:
                for s in pub.submissions:
                    if t.attack == "none" or s.contributor not in byz:
                        needs[(t.shas[s.base], s.contributor, s.draw)] = t.versions[s.base]
            cache.ensure(needs)
            for t, pub in active:
                deltas = [None if t.attack != "none" and s.contributor in byz
                          else cache.load(t.shas[s.base], s.contributor, s.draw) for s in pub.submissions]
                if not shapes:  # LoRA merges keep only the changed weights: the same names each run
                    shapes = {k: base0[k].shape for d in deltas if d for k in d}
                refusal = merge(t, pub, deltas, cfg, shapes)
                t.resolve(refusal)
                if refusal is None:
                    t.shas.append(_sha(base_bytes(base0, t.versions[-1])))
                    t.losses.append(evaluator.loss(t.versions[-1]))
            log(f"step {step}: {len(active)} publishes, {cache.trained} trained, {cache.hits} cached, "
                f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    finally:
        cache.close()
    doc = report(cfg, trajs, times=times, byz=byz, base_loss=base_loss, t_sync=t_sync,
                 horizon=horizon, cache=cache, seconds=time.perf_counter() - t_start)
    return doc, trajs


# ---- the JSON document and the plot --------------------------------------------------------------
def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


def time_to(t: Trajectory, target: float) -> float | None:
    """Simulated time of t's first version whose held-out loss is <= target (None: never)."""
    return next((tm for tm, loss in zip(t.times, t.losses) if loss <= target), None)


def report(cfg: BenchConfig, trajs: list[Trajectory], *, times: list[float], byz: tuple[int, ...],
           base_loss: float, t_sync: float, horizon: float, cache: DeltaCache, seconds: float) -> dict:
    by = {(t.mode, t.rule, t.attack): t for t in trajs}
    runs = {}
    for t in trajs:
        sch = t.schedule if t.schedule is not None else t.clock.schedule()
        stale = [s.staleness for p in sch.publishes[:len(t.versions) - 1] for s in p.submissions]
        cell = {"times": [round(x, 3) for x in t.times], "losses": [round(x, 5) for x in t.losses],
                "final_loss": round(t.losses[-1], 5), "final_time": round(t.times[-1], 3),
                "versions": len(t.versions) - 1, "error": t.error,
                "wasted_compute_share": round(sch.waste_share, 4),
                "waiting_share": round(sch.waiting / max(sch.compute_used + sch.compute_wasted, 1e-12), 4),
                "refused_stale": sch.refused, "reopened": t.reopened,
                "staleness_histogram": {str(s): stale.count(s) for s in sorted(set(stale))}}
        if t.mode == "async":
            cell["staleness_weights"] = [[round(w, 4) for w in ws] for ws in t.weights]
        if t.attack != "none":
            cell["byzantine_per_publish"] = [sum(s.contributor in byz for s in p.submissions)
                                             for p in sch.publishes[:len(t.versions) - 1]]
            cell["byzantine_weight_per_publish"] = [round(x, 4) for x in t.byzantine_weight]
            cell["byzantine_refused_by_validation_per_publish"] = t.byzantine_refused
            cell["byzantine_refused_by_validation_share"] = round(
                sum(t.byzantine_refused) / max(sum(cell["byzantine_per_publish"]), 1), 4)
            own = by.get((t.mode, t.rule, "none"))
            if own is not None:
                cell["ratio_to_own_clean"] = round(t.losses[-1] / own.losses[-1], 4)
        if t.mode == "async" and t.attack == "none" and ("sync", t.rule, "none") in by:
            target = by[("sync", t.rule, "none")].losses[-1]
            reached = time_to(t, target)
            cell["sync_final_loss"] = round(target, 5)
            cell["time_to_sync_final_loss"] = None if reached is None else round(reached, 3)
            cell["time_share_of_sync"] = None if reached is None else round(reached / t_sync, 4)
            sync_t = by[("sync", t.rule, "none")]  # the same for each of sync's earlier rounds
            cell["time_share_to_sync_round_loss"] = {
                f"round {r}": None if (x := time_to(t, loss)) is None else round(x / sync_t.times[r], 4)
                for r, loss in enumerate(sync_t.losses[1:], start=1)}
        runs[t.name] = cell
    robust = {r: {a: runs[f"async/{r}/{a}"].get("ratio_to_own_clean") for a in cfg.attacks if a != "none"}
              for r in cfg.rules if not r.startswith("mean") and cfg.f}
    plain = [r for r in ("mean", "mean-unchecked") if r in cfg.rules]
    mean_broken = {a: {**{r: runs[f"async/{r}/{a}"].get("ratio_to_own_clean") for r in plain},
                       **{f"{r}: byzantine rows refused by the norm check": runs[f"async/{r}/{a}"].get(
                           "byzantine_refused_by_validation_share") for r in plain}}
                   for a in cfg.attacks if a != "none" and cfg.f}
    judged = plain[-1] if plain else None  # the rule alone when run (its norm check off), else mean
    shares = {r: runs[f"async/{r}/none"].get("time_share_of_sync") for r in cfg.rules}
    async_waste = runs[f"async/{cfg.rules[0]}/none"]["wasted_compute_share"]
    return {
        "benchmark": "async",
        "command": " ".join(["python", "benchmarks/async.py", *sys.argv[1:]]),
        "protocol": {"text": (__doc__ or "").split("Protocol (also written into the JSON under "
                                                   "\"protocol\"):")[1].split("Prints the JSON")[0].strip(),
                     "config": asdict(cfg)},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    **{m: _version(m) for m in ("transformers", "peft", "trl")},
                    "cpu_count": os.cpu_count(), "workers": cache.workers},
        "seconds": round(seconds, 1),
        "trainings": cache.trained, "cache_hits": cache.hits,
        "train_seconds_sum": round(cache.train_seconds, 1),
        "compute_times": [round(x, 3) for x in times],
        "byzantine_ids": list(byz),
        "base_loss": round(base_loss, 5),
        "sync_time": round(t_sync, 3), "async_horizon_time": round(horizon, 3),
        "server_flags": {r: server_flags(cfg, r) for r in cfg.rules},
        "runs": runs,
        "targets": {
            "time_share_of_sync": shares,
            "time_pass": {r: v is not None and v <= cfg.time_target for r, v in shares.items()},
            "sync_wasted_compute_share": runs[f"sync/{cfg.rules[0]}/none"]["wasted_compute_share"],
            "async_wasted_compute_share": async_waste,
            "waste_pass": async_waste <= cfg.waste_target,
            "robust_ratio_to_own_clean": robust,
            "robust_pass": {r: all(v is not None and v <= 1 + cfg.tolerance for v in vs.values())
                            for r, vs in robust.items()},
            "mean_ratio_to_own_clean": mean_broken,
            "mean_broken_judged_on": judged,
            "mean_broken_pass": judged is not None and all(
                mean_broken.get(a, {}).get(judged, 0) >= cfg.broken_ratio for a in ("sign_flip", "scaling")),
        },
    }


def _spread(values: list[float | None]) -> dict:
    """Mean, standard deviation, min and max over seeds of the values that exist (None: not reached)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"per_seed": values, "n": 0}
    mean = sum(got) / len(got)
    std = (sum((v - mean) ** 2 for v in got) / (len(got) - 1)) ** 0.5 if len(got) > 1 else 0.0
    return {"per_seed": values, "n": len(got), "mean": round(mean, 4), "std": round(std, 4),
            "min": round(min(got), 4), "max": round(max(got), 4)}


def over_seeds(docs: dict[int, dict], cfg: BenchConfig) -> dict:
    """One document for several seeds (each seed draws its own clock, so its own deltas): the headline
    figures as mean, spread and per-seed values, then every seed's own document under "seeds"."""
    first = next(iter(docs.values()))
    tg = {seed: d["targets"] for seed, d in docs.items()}
    shares = {r: _spread([t["time_share_of_sync"][r] for t in tg.values()]) for r in cfg.rules}
    for r, sp in shares.items():  # a seed that never got there counts as the horizon, a lower bound
        sp["not_reached_by_horizon"] = len(docs) - sp["n"]
        if sp["n"] < len(docs):
            vals = [cfg.async_horizon if v is None else v for v in sp["per_seed"]]
            sp["mean_lower_bound"] = round(sum(vals) / len(vals), 4)
    robust = {r: {a: _spread([t["robust_ratio_to_own_clean"][r][a] for t in tg.values()])
                  for a in first["targets"]["robust_ratio_to_own_clean"][r]}
              for r in first["targets"]["robust_ratio_to_own_clean"]}
    plain = {a: {k: _spread([t["mean_ratio_to_own_clean"][a][k] for t in tg.values()]) for k in row}
             for a, row in first["targets"]["mean_ratio_to_own_clean"].items()}
    judged = first["targets"]["mean_broken_judged_on"]
    headline = {
        "seeds": list(docs),
        "time_share_of_sync": shares,
        "time_pass": {r: sp["n"] == len(docs) and sp["mean"] <= cfg.time_target for r, sp in shares.items()},
        "sync_wasted_compute_share": _spread([t["sync_wasted_compute_share"] for t in tg.values()]),
        "async_wasted_compute_share": _spread([t["async_wasted_compute_share"] for t in tg.values()]),
        "waste_pass": all(t["waste_pass"] for t in tg.values()),
        "robust_ratio_to_own_clean": robust,
        "robust_pass": {r: all(t["robust_pass"][r] for t in tg.values()) for r in robust},
        "mean_ratio_to_own_clean": plain,
        "mean_broken_judged_on": judged,
        "mean_broken_pass": all(t["mean_broken_pass"] for t in tg.values()),
    }
    keep = ("seconds", "trainings", "cache_hits", "train_seconds_sum", "compute_times", "byzantine_ids",
            "base_loss", "sync_time", "async_horizon_time", "runs", "targets")
    return {"benchmark": "async", "command": first["command"],
            "protocol": {**first["protocol"], "config": {**first["protocol"]["config"], "seed": list(docs)}},
            "machine": first["machine"], "server_flags": first["server_flags"],
            "seconds": round(sum(d["seconds"] for d in docs.values()), 1),
            "trainings": sum(d["trainings"] for d in docs.values()), "headline": headline,
            "seeds": {str(seed): {k: d[k] for k in keep} for seed, d in docs.items()}}


def first_seed(doc: dict) -> dict:
    """The first seed's document (with the protocol) from an over_seeds document: what the plot shows."""
    seed = doc["headline"]["seeds"][0]
    return {**doc["seeds"][str(seed)], "protocol": {**doc["protocol"], "config": {
        **doc["protocol"]["config"], "seed": seed}}}


def plot(doc: dict, path: pathlib.Path) -> pathlib.Path:
    """Held-out loss against simulated time: clean sync vs async (left), async under attack (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = doc["protocol"]["config"]
    colors = dict(zip(RULES, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")))
    styles = {"none": "-", "sign_flip": "--", "alie": ":", "scaling": "-."}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for name, run in doc["runs"].items():
        mode, rule, attack = name.split("/")
        if attack == "none":
            axes[0].plot(run["times"], run["losses"], styles["none"] if mode == "async" else ":",
                         marker="o" if mode == "sync" else ".", color=colors[rule], label=f"{mode} {rule}")
        if mode == "async":
            axes[1].plot(run["times"], run["losses"], styles[attack], color=colors[rule],
                         label=f"{rule}, {attack.replace('none', 'no attack')} (ends {run['final_loss']:.3g})")
    # zoom on the plateau: the base loss and a broken mean run leave the axes (their ends are labelled)
    finals = [r["final_loss"] for r in doc["runs"].values()]
    axes[0].set_ylim(min(finals) - 0.05, 1.6 * min(finals))
    for rule in cfg["rules"]:
        if f"sync/{rule}/none" in doc["runs"]:
            axes[0].axhline(doc["runs"][f"sync/{rule}/none"]["final_loss"], color=colors[rule], lw=0.6,
                            ls=(0, (1, 4)))
    axes[0].axvline(doc["sync_time"] * cfg["time_target"], color="grey", lw=0.8, ls="--",
                    label=f"{cfg['time_target']} x sync time")
    axes[0].set_title(f"no attack: sync (dotted; its final loss: thin lines) vs async K={cfg['buffer_size']}",
                      fontsize=10)
    axes[1].set_title(f"async, {cfg['f']} of {cfg['n']} Byzantine")
    for ax in axes:
        ax.set_xlabel("simulated wall-clock (fastest contributor's local run = 1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out loss")
    fig.suptitle(f"{cfg['n']} contributors, compute times spanning {cfg['speed_span']:g}x, "
                 f"{cfg['dropout']:.0%} dropout per run; seed {cfg['seed']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    knobs = (("n", int), ("f", int), ("rounds", int), ("buffer-size", int), ("max-staleness", int),
             ("staleness-exponent", float), ("server-lr", float), ("async-horizon", float),
             ("max-versions", int), ("steps", int), ("trim-beta", float), ("seed", int), ("same-base", str),
             ("buffer-f", int), ("buffer-multi-krum-m", int), ("staleness-applied", str))
    for name, typ in knobs:
        p.add_argument(f"--{name}", type=typ)
    p.add_argument("--rules", nargs="+", choices=RULES)
    p.add_argument("--attacks", nargs="+", choices=ATTACKS)
    p.add_argument("--sync-attacks", action="store_true", help="also run sync rounds under attack")
    p.add_argument("--staleness-normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="scale a flush by K / the sum of its staleness weights (default: on, as the server)")
    p.add_argument("--seeds", type=int, nargs="+", help="run every seed (its own clock) and report the "
                   "headline over them (mean, spread, per seed); the plot shows the first")
    p.add_argument("--workers", type=int, default=1, help="training processes (one thread each)")
    p.add_argument("--cache-dir", type=pathlib.Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=pathlib.Path, help="JSON path (default results/async.json; the PNG "
                   "beside it; --quick writes nothing unless given)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    kw: dict = dict(QUICK) if args.quick else {}
    for name, _ in knobs:
        key = name.replace("-", "_")
        if getattr(args, key) is not None:
            kw[key] = getattr(args, key)
    if args.rules:
        kw["rules"] = tuple(args.rules)
    if args.attacks:
        kw["attacks"] = tuple(args.attacks)
    if args.sync_attacks:
        kw["sync_attacks"] = True
    if args.staleness_normalize is not None:
        kw["staleness_normalize"] = args.staleness_normalize
    try:
        cfg = BenchConfig(**kw)
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seeds:
        docs = {seed: run(replace(cfg, seed=seed), workers=args.workers, cache_dir=args.cache_dir, log=print)[0]
                for seed in args.seeds}
        doc = over_seeds(docs, cfg)
    else:
        doc, _ = run(cfg, workers=args.workers, cache_dir=args.cache_dir, log=print)
    text = json.dumps(doc, indent=1)
    print(text)
    out = args.out if args.out else (None if args.quick else RESULTS / "async.json")
    if out is not None and not args.no_write:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        try:
            plot(doc if "runs" in doc else first_seed(doc), out.with_suffix(".png"))
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[dev]'): no PNG", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
