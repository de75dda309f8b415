"""DeltaSoup: one round of validate -> clip -> group copies -> rule -> noise -> report, streamed.

The server's `DeltaSource` hands out one tensor for all n contributors at a time, so memory grows
with one tensor x n, never the model x n. The rule is an object (`rules/`, named once by
`SoupConfig.rule`); differential privacy is a step around it (`dp.py`; semantics in privacy.py).
Each step and what it costs: docs/design/aggregation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .config import SoupConfig
from .dp import DifferentialPrivacy, Release
from .errors import NotRobustConfigError, SoupConfigError
from .krum import duplicate_groups
from .privacy import PrivacyAccountant, PrivacyReport
from .rules.base import Plan, RoundView
from .sketched_copies import EXACT_MAX, groups_from_sketch, sketch
from .scratch import Scratch
from .streaming import ClippedRows, read_ahead
from .validation import Validated, validate
from .weights import cap_weights


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
    """The pipeline: the config's rule wrapped in its DP step (which holds the adaptive clip norm)."""

    def __init__(self, config: SoupConfig, *, dp_clip: float | None = None) -> None:
        self.config = config
        self.rule = config.rule
        self.dp = DifferentialPrivacy(self.rule, config, clip=dp_clip)

    @property
    def dp_clip(self) -> float | None:
        """The clip norm the next round uses."""
        return self.dp.clip

    def run(self, source: DeltaSource, sink: Callable[[str, Tensor], None], *,
            weights: Tensor | None = None, generator: torch.Generator | None = None,
            accountant: PrivacyAccountant | None = None,
            population: int | None = None, sample_rate: float | None = None,
            lend_aggregates: bool = False, reference: Any = None,
            publish: Callable[[Plan, ClippedRows, Release, dict[str, int]], None] | None = None,
            distances: Callable[[ClippedRows], Tensor] | None = None) -> SoupReport:
        """Aggregate the round; `sink(name, aggregate)` receives each tensor flat (numel,) float32.
        `sample_rate`: the probability with which the caller sampled each person (accounted as q).
        `lend_aggregates`: the sink uses each aggregate before it returns and keeps no reference to it, so a
        LoRA mean is written into one buffer reused tensor after tensor (a fresh 100 MB product faults its
        pages in every time: 3x the matmul's own time at 4B).
        `reference`: the operator's direction (a mapping tensor name -> tensor, e.g. the negative gradient of its
        validation loss) for a rule that weighs each delta by its agreement with it (trust-mean).
        `publish(plan, rows, release, numels)`: the last pass done elsewhere (the server's Ray engine), instead of
        the per-tensor loop into `sink`; it must leave `plan`'s diagnostics as that loop would.
        `distances(rows)`: the (k, k) whole-model squared distances a pairwise rule needs, computed elsewhere (the
        Ray engine's tasks, row block by row block) instead of `rows.pairwise_sq_distances()` here."""
        n, names = len(source.contributors), list(source.names())
        checked = self._validate(source, names, n)
        rows = self._clip(source, names, checked)
        release = self.dp.open(submitted=n, population=population, accountant=accountant,
                               sample_rate=sample_rate)
        view = self._view(rows, release, checked, weights=weights, reference=reference, distances=distances)
        plan = self.rule.plan(view)
        if publish is not None:
            release.start(generator)
            publish(plan, rows, release, checked.numels)
        else:
            self._publish(plan, rows, release, checked.numels, sink, generator=generator,
                          scratch=Scratch() if lend_aggregates else None)
        next_clip = release.close(checked.norms[rows.acc], accountant=accountant)
        return self._report(list(source.contributors), checked, rows, plan, release, next_clip)

    def _validate(self, source: DeltaSource, names: Sequence[str], n: int) -> Validated:
        """Pass 1, then refuse the round if too few were accepted for `min_contributors` or the rule."""
        cfg = self.config
        checked = validate(source, names, n, max_delta_norm=cfg.max_delta_norm,
                           max_norm_ratio=cfg.max_norm_ratio, private=self.dp.enabled)
        k = checked.accepted.numel()
        if k < cfg.min_contributors:
            raise NotRobustConfigError(f"only {k} contribution(s) accepted, min_contributors is "
                                       f"{cfg.min_contributors}; nothing is published this round")
        self.rule.check_round(submitted=n, accepted=k)
        return checked

    def _clip(self, source: DeltaSource, names: Sequence[str], checked: Validated) -> ClippedRows:
        acc = checked.accepted
        return ClippedRows(source, names, acc, self.dp.clip_factors(checked.norms[acc]),
                           len(checked.reasons))

    def _view(self, rows: ClippedRows, release: Release, checked: Validated, *,
              weights: Tensor | None, reference: Any = None,
              distances: Callable[[ClippedRows], Tensor] | None = None) -> RoundView:
        """The rule's view: weights as the DP step allows, then the copies grouped, decided once."""
        acc, k = rows.acc, rows.acc.numel()

        def server_weights() -> Tensor:  # capped; never a contributor's own claim
            w_in = None if weights is None else torch.as_tensor(weights, dtype=torch.float64)[acc]
            return cap_weights(w_in, n=k, max_share=self.config.max_weight_share)

        w = release.weighting(k, server_weights)
        distances, groups = self._group_copies(rows, distances)
        if self.rule.needs_reference and reference is None:
            raise SoupConfigError(f"aggregator {self.rule.name!r} needs the operator's reference direction "
                                  "(DeltaSoup.run(reference=...)): none was given")
        cos = rows.cosines_to(reference) if self.rule.needs_reference else None
        return RoundView(submitted=rows.n, weights=w.weights, weighted=w.weighted,
                         denominator=w.denominator, factored=w.factored,
                         norms=checked.norms[acc] * rows.factors, distances=distances, groups=groups,
                         distances_to=rows.sq_distances_to, reference_cos=cos)

    def _group_copies(self, rows: ClippedRows, computed: Callable[[ClippedRows], Tensor] | None = None
                      ) -> tuple[Tensor | None, Tensor | None]:
        """((k, k) whole-model squared distances, (k,) each row's group of copies), as the rule needs; a rule that
        needs distances only for the groups gets them from a sketch above EXACT_MAX rows (sketched_copies.py)."""
        if not self.rule.needs_distances:
            return None, None
        k = rows.acc.numel()
        if self.rule.copies_only and k > EXACT_MAX:  # k^2 x d work and a (k, k) matrix otherwise: a sketch
            parts = ((f"{name}@{a}", part) for name in rows.names for a, _, part in rows.parts(name))
            s = sketch(((key, lambda x=x: x) for key, x in read_ahead(parts)), k)
            return None, torch.from_numpy(groups_from_sketch(s))
        distances = computed(rows) if computed is not None else rows.pairwise_sq_distances()
        if not self.rule.counts_copies_once:
            return distances, None
        return distances, torch.from_numpy(duplicate_groups(distances))

    @staticmethod
    def _publish(plan: Plan, rows: ClippedRows, release: Release, numels: dict[str, int],
                 sink: Callable[[str, Tensor], None], *, generator: torch.Generator | None,
                 scratch: Scratch | None) -> None:
        """The last pass: per tensor the rule's aggregate plus the DP noise, handed to `sink`."""
        release.start(generator)
        d_total = sum(numels.values())
        for name in rows.names:
            out = scratch.get(numels[name]) if scratch is not None else None
            agg = plan.from_factors(rows.source, name, rows.acc, rows.factors, out=out)
            if agg is None:
                parts = rows.parts(name)
                if len(parts) == 1:
                    share = numels[name] / d_total if d_total else 0.0
                    agg = plan.aggregate(parts[0][2](), share=share)
                else:  # a block of the tensor's rows at a time (streaming.row_blocks), then noised whole
                    agg = out if out is not None else torch.empty(numels[name])
                    for (a, b), x in read_ahead(((a, b), part) for a, b, part in parts):
                        agg[a:b] = plan.aggregate(x, share=(b - a) / d_total if d_total else 0.0)
                agg = release.noise(agg)
            sink(name, agg.to(torch.float32))

    def _report(self, ids: list[str], checked: Validated, rows: ClippedRows, plan: Plan,
                release: Release, next_clip: float | None) -> SoupReport:
        diag = plan.diagnostics()
        pos = {int(i): j for j, i in enumerate(rows.acc.tolist())}
        out = []
        for i, cid in enumerate(ids):
            j, norm = pos.get(i), float(checked.norms[i])
            if j is None:
                out.append(ContributorReport(cid, False, checked.reasons[i], norm, 0.0, float("nan"),
                                             False, 1.0, 0.0))
            else:
                out.append(ContributorReport(cid, True, None, norm, float(rows.factors[j]),
                                             float(diag.score[j]), bool(diag.selected[j]),
                                             float(diag.trimmed_share[j]), float(diag.weight_used[j])))
        return SoupReport(aggregator=self.rule.name, contributors=tuple(out), n_accepted=len(pos),
                          noise_std=release.noise_std, privacy=release.privacy, next_dp_clip=next_clip,
                          note=plan.note)
