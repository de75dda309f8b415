"""DeltaSoup: the round pipeline validate -> clip -> robust aggregate -> noise -> result.

Streaming: the server's `DeltaSource` hands out one tensor for all n contributors at a time, so
memory grows with one tensor x n, never the whole model x n.
  pass 1: per contributor finiteness and whole-delta L2 norm (from the source's `sq_norms` when it
          has one, e.g. LoRA factors' r x r Gram matrices, so nothing is decoded; not under DP)
          -> refuse invalid contributions
          with a reason (non-finite, zero, above max_delta_norm, above max_norm_ratio x the
          round's lower median norm); clip factors; the privacy budget check (before any output);
  pass 2 (krum, multi-krum, bulyan; the other robust rules, to count copies once): exact pairwise
          squared distances of the CLIPPED deltas summed over tensors, straight from the BitDelta
          bits when `packed()` is available (consecutive packed tensors batched up to 16 MiB of sign
          bytes per contributor); the selection (or the groups of copies) is fixed once from them;
  iteration passes (geometric-median, centered-clip): each iteration's distances from every
          accepted contributor to the current combination v = sum_j a_j x_j are summed over the
          tensors, per tensor v formed in float64 from that tensor alone (exact, see
          distances.py; the pairwise matrix alone cannot give them exactly once an outlier is
          huge). One pass over the model per iteration: centered clipping takes cc_iters - 1
          passes (default 2; its first distances, to the zero delta, are the pass-1 norms);
          the geometric median at most gm_max_iter (default 32, fewer once the iterate moves by
          less than gm_eps x the median distance; from its coordinate-wise median start, a
          handful on honest rounds even with outliers at 1e30). The server's source caches
          decoded rows for small models, so a pass there costs arithmetic only; on a model
          larger than that cache every pass decodes the payloads again;
  pass 3: per tensor: clip, aggregate with that selection or those coefficients (float64
          accumulation), add noise, `sink(name, flat_tensor)`; for the iterated rules it also
          sums each contributor's distance to the (pre-noise) aggregate, its reported score.
The trimmed mean's n >= 2k + 1 is checked on the round's submissions; when validation leaves only
one or two of them (copies counted once), those are averaged untrimmed (two values' coordinate-wise
median) and `SoupReport.note` says so: refusing a huge delta must not stop the honest rest from publishing.
DP semantics and what the guarantee covers: see `privacy.py`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ._checks import combine, combine64
from .bulyan import bulyan, check_bulyan_config
from .centered_clip import centered_clip_iterate
from .clipping import adaptive_clip_update, clip_factors, update_noise_multiplier
from .config import SoupConfig
from .copies import split_weights
from .distances import (combination_sq_distances, packed_model_sq_distances, pairwise_sq_distances,
                        sq_distances_to)
from .errors import InvalidDeltaError, NotRobustConfigError, PrivacyBudgetExceeded
from .geometric_median import weiszfeld
from .lora_mean import factored_mean
from .krum import check_krum_config, duplicate_groups, krum_selection
from .median import median
from .privacy import PrivacyAccountant, PrivacyReport, gaussian_noise, rdp_epsilon, secure_generator
from .trimmed_mean import trim_count, trimmed_mean
from .weights import cap_weights

# sign bytes per contributor batched into one compressed-domain distance pass: bounds memory at
# about n x 16 MiB while removing per-tensor Python work on models with many small tensors
_PACKED_BATCH_BYTES = 16 << 20
# Rules that need the whole-model pairwise distances: the selection rules, and the others that count copies
# once (krum.duplicate_groups -> copies.py). One more pass over the model; on BitDelta payloads
# the packed XOR pass: 22 ms for 31M parameters at n = 10, 0.3% of the trimmed mean, though the whole call
# measured 1.13x without copies, not yet explained (benchmarks/trimmed_copies.py).
_COPIES_ONCE = ("trimmed-mean", "median", "geometric-median", "centered-clip")
_NEEDS_DISTANCES = ("krum", "multi-krum", "bulyan", *_COPIES_ONCE)
_ITERATED = ("geometric-median", "centered-clip")


class DeltaSource(Protocol):
    """What the server provides over the round's stored payloads."""

    contributors: Sequence[str]

    def names(self) -> Sequence[str]: ...

    def stacked(self, name: str) -> Tensor: ...  # (n, numel) float32

    def packed(self, name: str) -> Sequence[Any] | None: ...  # n BitDeltaPacked, or None

    # Optional (looked up with getattr): ((n,) float64 squared L2 norms of stacked(name)'s rows, numel)
    # without decoding, e.g. from LoRA factors; None when it cannot vouch for them (finite rows, an
    # accurate norm), then pass 1 decodes. Unused under DP, whose sensitivity is on the decoded rows.
    # def sq_norms(self, name: str) -> tuple[Tensor, int] | None: ...
    # Optional: the n contributors' LoRA factors of tensor `name` (None for one that left it unchanged),
    # or None; only for tensors whose norms `sq_norms` vouched for. The plain mean then needs no rows.
    # def factors(self, name: str) -> Sequence[Any | None] | None: ...


@dataclass(frozen=True)
class ContributorReport:
    """One contributor's fate in the round."""

    contributor: str
    accepted: bool
    reason: str | None      # why refused (None when accepted)
    norm: float             # whole-delta L2 norm before clipping (nan if non-finite)
    clip_factor: float      # scale applied (1.0 = unclipped; 0.0 when refused)
    score: float            # aggregator score (nan if none)
    selected: bool          # influenced the aggregate
    trimmed_share: float    # share of coordinates discarded (numel-weighted over tensors)
    weight: float           # effective weight in the aggregate


@dataclass(frozen=True)
class SoupReport:
    """What the round did; stored with the round by the server."""

    aggregator: str
    contributors: tuple[ContributorReport, ...]
    n_accepted: int
    noise_std: float                 # per-coordinate std added to the published aggregate
    privacy: PrivacyReport | None
    next_dp_clip: float | None       # clip norm for the next round (adaptive clipping)
    note: str = ""                   # how the rule was adapted to this round, if it was


class DeltaSoup:
    """The pipeline; holds only the (adaptive) clip norm between rounds."""

    def __init__(self, config: SoupConfig, *, dp_clip: float | None = None) -> None:
        self.config = config
        self.dp_clip = config.dp_clip if dp_clip is None else dp_clip

    # ---- pass 1 -------------------------------------------------------------------------
    def _validate(self, source: DeltaSource, names: Sequence[str], n: int
                  ) -> tuple[Tensor, list[str | None], dict[str, int]]:
        sq = torch.zeros(n, dtype=torch.float64)
        reasons: list[str | None] = [None] * n
        numels: dict[str, int] = {}
        fast = None if self.config.dp_enabled else getattr(source, "sq_norms", None)
        for name in names:
            known = fast(name) if fast is not None else None
            if known is not None:  # finite rows vouched for by the source, their norms without a decode
                sq_name, numels[name] = known
                if tuple(sq_name.shape) != (n,):
                    raise InvalidDeltaError(f"DeltaSource.sq_norms({name!r}) must be shaped ({n},), "
                                            f"got {tuple(sq_name.shape)}")
                sq += sq_name.to(torch.float64)
                continue
            x = source.stacked(name)  # (n, numel)
            if x.dim() != 2 or x.shape[0] != n:
                raise InvalidDeltaError(f"DeltaSource.stacked({name!r}) must be shaped ({n}, numel), "
                                        f"got {tuple(x.shape)}")
            numels[name] = x.shape[1]
            # (n,) float64: a float32 square cannot overflow float64, so the norm is non-finite
            # exactly when the row is; only then is the row scanned for NaN/inf
            sq_x = torch.linalg.vector_norm(x, dim=1, dtype=torch.float64) ** 2
            finite = torch.isfinite(sq_x)
            if not bool(finite.all()):
                finite = torch.isfinite(x).all(dim=1)  # (n,)
                for i in (~finite).nonzero().flatten().tolist():
                    if reasons[i] is None:
                        reasons[i] = f"non-finite values (NaN or inf) in tensor {name!r}"
                sq_x = torch.linalg.vector_norm(torch.nan_to_num(x), dim=1, dtype=torch.float64) ** 2
            sq += torch.where(finite, sq_x, torch.zeros_like(sq))
        norms = sq.sqrt()
        for i in range(n):
            if reasons[i] is not None:
                norms[i] = float("nan")
            elif norms[i] == 0:
                reasons[i] = "zero delta: nothing to contribute (free rider)"
            elif self.config.max_delta_norm is not None and norms[i] > self.config.max_delta_norm:
                reasons[i] = (f"delta L2 norm {float(norms[i]):.4g} exceeds max_delta_norm "
                              f"{self.config.max_delta_norm:.4g}")
        ratio = self.config.max_norm_ratio
        usable = [float(v) for v in norms if math.isfinite(v) and v > 0]
        if ratio is not None and usable and not self.config.dp_enabled:
            # Not under DP: there the clip bounds every delta, and a refusal that depends on the
            # other contributors' norms would change the one-user sensitivity the noise assumes.
            ref = statistics.median_low(usable)
            for i in range(n):
                if reasons[i] is None and norms[i] > ratio * ref:
                    reasons[i] = (f"delta L2 norm {float(norms[i]):.4g} exceeds max_norm_ratio "
                                  f"{ratio:g} x the round's median delta norm {ref:.4g} "
                                  f"(= {ratio * ref:.4g})")
        return norms, reasons, numels

    def _check_rule(self, n_acc: int, n: int) -> None:
        cfg = self.config
        if n_acc < cfg.min_contributors:
            raise NotRobustConfigError(f"only {n_acc} contribution(s) accepted, min_contributors is "
                                       f"{cfg.min_contributors}; nothing is published this round")
        if cfg.aggregator in ("krum", "multi-krum"):
            check_krum_config(n=n_acc, f=cfg.byzantine_f, rule=cfg.aggregator)
            if cfg.multi_krum_m is not None and cfg.multi_krum_m > n_acc:
                raise NotRobustConfigError(f"`multi_krum_m`={cfg.multi_krum_m} exceeds the "
                                           f"{n_acc} accepted contributions")
        elif cfg.aggregator == "bulyan":
            check_bulyan_config(n=n_acc, f=cfg.byzantine_f)
        elif cfg.aggregator == "trimmed-mean":
            # Checked on the submissions: a round of n >= 3 whose validation refused all but one or
            # two (huge, broken, zero deltas) averages what is left (pass 3), which for two
            # values is their coordinate-wise median; fewer than 3 submissions are refused.
            trim_count(n=n, beta=cfg.trim_beta)

    @staticmethod
    def _rows(source: DeltaSource, name: str, acc: Tensor, factors: Tensor, n: int) -> Tensor:
        """(k, numel) float32: the accepted contributors' clipped rows of tensor `name`. Without a
        refusal or a clip this is the source's own tensor (no copy; nothing downstream mutates it):
        `x[acc] * 1.0` would be the same numbers in two more copies."""
        x = source.stacked(name)  # (n, numel)
        if acc.numel() < n:
            x = x[acc]
        if bool((factors != 1).any()):
            x = x * factors.to(torch.float32)[:, None]
        return x

    # ---- pass 2 -------------------------------------------------------------------------
    def _distances(self, source: DeltaSource, names: Sequence[str], acc: Tensor,
                   factors: Tensor, n: int) -> Tensor:
        k = acc.numel()
        idx = acc.tolist()
        dist = torch.zeros((k, k), dtype=torch.float64)
        batch: list[list[Any]] = [[] for _ in idx]  # batch[j]: accepted contributor j's tensors
        batch_bytes = 0
        for name in names:
            packed = source.packed(name)
            if packed is not None:  # BitDelta: batch tensors into one whole-model XOR pass
                for j, i in enumerate(idx):
                    batch[j].append(packed[i])
                batch_bytes += int(packed[idx[0]].signs.numel())
                if batch_bytes >= _PACKED_BATCH_BYTES:
                    dist += packed_model_sq_distances(batch, scale=factors)
                    batch, batch_bytes = [[] for _ in idx], 0
            else:
                dist += pairwise_sq_distances(self._rows(source, name, acc, factors, n))
        if batch_bytes:
            dist += packed_model_sq_distances(batch, scale=factors)
        return dist

    # ---- iteration passes --------------------------------------------------------------
    def _distances_to(self, source: DeltaSource, names: Sequence[str], acc: Tensor, factors: Tensor,
                      n: int, coefficients: Tensor | None, previous: Tensor | None = None
                      ) -> tuple[Tensor, float]:
        """One pass: ((k,) squared distances of the clipped deltas to sum_j a_j x_j, squared
        distance of that iterate from the previous one), summed over the tensors."""
        sq = torch.zeros(acc.numel(), dtype=torch.float64)
        move = 0.0
        for name in names:
            x = self._rows(source, name, acc, factors, n)  # (k, numel)
            s, m = combination_sq_distances(x, coefficients, previous=previous)
            sq += s
            move += m
        return sq, move

    def run(self, source: DeltaSource, sink: Callable[[str, Tensor], None], *,
            weights: Tensor | None = None, generator: torch.Generator | None = None,
            accountant: PrivacyAccountant | None = None,
            population: int | None = None) -> SoupReport:
        """Aggregate the round; `sink(name, aggregate)` receives each tensor flat (numel,) float32."""
        cfg = self.config
        ids = list(source.contributors)
        n = len(ids)
        names = list(source.names())
        norms, reasons, numels = self._validate(source, names, n)
        acc = torch.tensor([i for i in range(n) if reasons[i] is None], dtype=torch.int64)
        k = acc.numel()
        self._check_rule(k, n)
        d_total = sum(numels.values())

        # clip factors over the whole delta
        clip = self.dp_clip
        factors = (clip_factors(norms[acc], max_norm=clip) if clip is not None
                   else torch.ones(k, dtype=torch.float64))  # (k,)

        # privacy: check the budget before anything is published
        dp = cfg.dp_enabled
        m_exp = cfg.dp_expected_contributors or n
        privacy: PrivacyReport | None = None
        z_update = cfg.dp_noise_multiplier
        count_std = cfg.dp_clip_count_stddev or m_exp / 20.0
        if dp:
            if cfg.dp_adaptive_clip:
                z_update = update_noise_multiplier(noise_multiplier=cfg.dp_noise_multiplier,
                                                   count_stddev=count_std)
            q = min(1.0, m_exp / population) if population else 1.0
            acct = accountant if accountant is not None else PrivacyAccountant()
            eps_before = acct.epsilon(delta=cfg.dp_delta)
            eps_after = acct.epsilon_if_step(noise_multiplier=cfg.dp_noise_multiplier,
                                             sample_rate=q, delta=cfg.dp_delta)
            if cfg.dp_target_epsilon is not None and eps_after > cfg.dp_target_epsilon:
                raise PrivacyBudgetExceeded(epsilon_spent=eps_before, epsilon_if_published=eps_after,
                                            target=cfg.dp_target_epsilon, delta=cfg.dp_delta)
            privacy = PrivacyReport(
                epsilon_round=rdp_epsilon([(cfg.dp_noise_multiplier, q, 1)], delta=cfg.dp_delta),
                epsilon_total=eps_after, delta=cfg.dp_delta, q=q,
                noise_multiplier=cfg.dp_noise_multiplier, clip=float(clip),
                expected_contributors=m_exp, covers_aggregator=cfg.aggregator == "mean")

        # weights: uniform inside DP; otherwise server weights, capped
        if dp:
            w = torch.full((k,), 1.0 / k, dtype=torch.float64)
        else:
            w_in = None if weights is None else torch.as_tensor(weights, dtype=torch.float64)[acc]
            w = cap_weights(w_in, n=k, max_share=cfg.max_weight_share)

        # whole-model geometry, decided once
        score = torch.full((k,), float("nan"), dtype=torch.float64)
        coeff: Tensor | None = None  # (k,) for linear rules
        total: float | None = None  # what coeff is divided by (None: its sum)
        dist: Tensor | None = None
        selected = torch.ones(k, dtype=torch.bool)
        groups: Tensor | None = None  # coordinate-wise rules: each row's group of copies
        if cfg.aggregator in _NEEDS_DISTANCES:
            dist = self._distances(source, names, acc, factors, n)
            if cfg.aggregator in _COPIES_ONCE:
                groups = torch.from_numpy(duplicate_groups(dist))
        distinct = k if groups is None else int(torch.unique(groups).numel())  # rows, copies once
        if groups is not None and distinct < k and cfg.aggregator in _ITERATED:
            w = split_weights(w, groups)  # a group of copies weighs one row
        if cfg.aggregator == "mean":
            if dp:  # fixed denominator: the sum over the m_exp expected contributors (privacy.py)
                coeff, total = torch.ones(k, dtype=torch.float64), float(m_exp)
            else:
                coeff = w
        elif cfg.aggregator in ("krum", "multi-krum"):
            m = 1 if cfg.aggregator == "krum" else cfg.multi_krum_m
            score, shares = krum_selection(dist, f=cfg.byzantine_f, m=m)
            coeff = shares * w  # copies share one row's weight
            coeff = coeff / coeff.sum()
            selected = coeff > 0
        elif cfg.aggregator == "geometric-median":
            coeff = weiszfeld(lambda a, p: self._distances_to(source, names, acc, factors, n, a, p),
                              n=k, weights=w, eps=cfg.gm_eps, max_iter=cfg.gm_max_iter, nu=cfg.gm_nu)
        elif cfg.aggregator == "centered-clip":
            a, _ = centered_clip_iterate(
                lambda c: self._distances_to(source, names, acc, factors, n, c[1:])[0],
                norms[acc] * factors,  # distances to the center, the zero delta: the norms
                tau=cfg.cc_tau, iters=cfg.cc_iters, weights=w)
            coeff = a[1:]  # the center's coefficient multiplies the zero vector
            total = float(a.sum())
        score_sq = torch.zeros(k, dtype=torch.float64)  # iterated rules: distance to the aggregate

        # pass 3: aggregate, noise, publish
        z_std = z_update * clip / m_exp if dp else 0.0
        gen = secure_generator() if cfg.dp_secure_noise else generator
        if dp and gen is None:
            raise InvalidDeltaError("DP noise needs randomness: pass `generator=` or set dp_secure_noise")
        trimmed = torch.zeros(k, dtype=torch.float64)
        used = torch.zeros(k, dtype=torch.float64)
        for name in names:
            if cfg.aggregator == "mean" and not dp:  # LoRA factors: one matmul, no (k, numel) rows
                agg = factored_mean(source, name, acc, factors, coeff, total=total)
                if agg is not None:
                    sink(name, agg)
                    continue
            x = self._rows(source, name, acc, factors, n)  # (k, numel)
            if coeff is not None and cfg.aggregator in _ITERATED:
                v = combine64(coeff, x, total=total)  # (numel,) float64
                score_sq += sq_distances_to(x, v)
                agg = v.to(x.dtype)
            elif coeff is not None:
                agg = combine(coeff, x, total=total)  # (numel,) combine64's numbers, in x's dtype
            else:
                if cfg.aggregator == "median":
                    res = median(x, groups=groups)
                elif cfg.aggregator == "trimmed-mean":
                    res = trimmed_mean(x, beta=cfg.trim_beta if distinct >= 3 else 0.0,
                                       weights=None if dp else w, groups=groups)
                else:
                    res = bulyan(x, f=cfg.byzantine_f, distances=dist)
                agg = res.aggregate
                share = numels[name] / d_total
                trimmed += res.diagnostics.trimmed_share * share
                used += res.diagnostics.weight_used * share
                selected = res.diagnostics.selected if cfg.aggregator == "bulyan" else selected
            if dp:
                agg = agg + gaussian_noise(tuple(agg.shape), std=z_std, generator=gen,
                                           secure=cfg.dp_secure_noise, dtype=agg.dtype)
            sink(name, agg.to(torch.float32))

        if cfg.aggregator in _ITERATED:
            score = score_sq.sqrt()
        weight_used = used if coeff is None else coeff if total is None else coeff / total
        if coeff is not None:
            trimmed = (~selected).to(torch.float64)
        next_clip = clip
        if dp and cfg.dp_adaptive_clip:
            next_clip = adaptive_clip_update(norms[acc], clip=clip,
                                             target_quantile=cfg.dp_target_quantile,
                                             lr=cfg.dp_clip_lr, count_stddev=count_std,
                                             expected_contributors=m_exp, generator=gen,
                                             secure=cfg.dp_secure_noise)
            self.dp_clip = next_clip
        if dp and accountant is not None:
            accountant.step(noise_multiplier=cfg.dp_noise_multiplier, sample_rate=privacy.q)

        note = ""
        if cfg.aggregator == "trimmed-mean" and distinct < 3 and cfg.trim_beta > 0:
            note = (f"trimmed-mean: validation left {k} of {n} submissions" + (
                    f", {distinct} distinct (copies count once)" if distinct < k else "") +
                    "; averaged untrimmed (for two, their coordinate-wise median)")
        rows = []
        pos = {int(i): j for j, i in enumerate(acc.tolist())}
        for i, cid in enumerate(ids):
            j = pos.get(i)
            if j is None:
                rows.append(ContributorReport(cid, False, reasons[i], float(norms[i]), 0.0,
                                              float("nan"), False, 1.0, 0.0))
            else:
                rows.append(ContributorReport(cid, True, None, float(norms[i]), float(factors[j]),
                                              float(score[j]), bool(selected[j]),
                                              float(trimmed[j]), float(weight_used[j])))
        return SoupReport(aggregator=cfg.aggregator, contributors=tuple(rows), n_accepted=k,
                          noise_std=z_std, privacy=privacy, next_dp_clip=next_clip, note=note)
