"""The `Rule` interface: a rule's typed settings, what it needs from the pipeline, and its `Plan`.

`DeltaSoup` asks a rule what it needs (`needs_distances`, `counts_copies_once`, `check_round`),
hands it a `RoundView` of the round's accepted, clipped contributions, and gets back a `Plan`: the
whole-model decision (coefficients, a selection), which then aggregates one tensor at a time. The
maths lives in the pure functions beside the rules (krum.py, trimmed_mean.py, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import combine, combine64
from ..copies import split_weights
from ..distances import sq_distances_to
from ..errors import NotRobustConfigError
from ..lora_mean import factored_mean
from ..result import AggregateResult, Diagnostics

# (coefficients or None for the coordinate-wise median, previous coefficients or None) ->
# ((k,) squared distances of the clipped rows to sum_j a_j x_j, squared distance from the previous one)
DistancesTo = Callable[[Tensor | None, Tensor | None], tuple[Tensor, float]]


@dataclass(frozen=True)
class RoundView:
    """What a rule sees of the round: k accepted, clipped contributions, decided once for the model."""

    submitted: int               # contributions received, before validation
    weights: Tensor              # (k,) float64 shares summing to 1 (uniform under DP)
    weighted: bool               # False under DP: every contribution weighs the same
    denominator: float | None    # the mean's fixed denominator (DP: expected contributors), else None
    factored: bool               # the mean may be formed from LoRA factors (not under DP)
    norms: Tensor                # (k,) float64 clipped whole-delta norms: distances to the zero delta
    distances: Tensor | None     # (k, k) float64 whole-model squared distances (`needs_distances`)
    groups: Tensor | None        # (k,) each row's group of copies (`counts_copies_once`)
    distances_to: DistancesTo    # one pass over the model
    reference_cos: Tensor | None = None  # (k,) cosine of each row with the reference direction (`needs_reference`)

    @property
    def k(self) -> int:
        return int(self.weights.numel())

    def __reduce__(self):
        """Pickled without `distances_to`, a pass over the coordinator's source (a sharded round ships the plans,
        whose per-tensor functions may hold the view, to other processes; `Plan.aggregate` never calls it)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (_rebuilt_view, (dict(values, distances_to=_no_passes),))

    @property
    def distinct(self) -> int:
        """Rows, copies counted once."""
        return self.k if self.groups is None else int(torch.unique(self.groups).numel())

    def split_weights(self) -> Tensor:
        """(k,) the weights with each group of copies weighing one row (rules weighting all rows)."""
        if self.groups is not None and self.distinct < self.k:
            return split_weights(self.weights, self.groups)
        return self.weights


def _rebuilt_view(values: dict[str, Any]) -> RoundView:
    return RoundView(**values)


def _no_passes(coefficients: Tensor | None, previous: Tensor | None = None) -> tuple[Tensor, float]:
    raise RuntimeError("a plan's copy in another process cannot take whole-model passes: only its coordinator can")


class Plan:
    """A rule's decision for one round; `aggregate` is called once per tensor, in order."""

    note: str = ""  # how the rule was adapted to this round, if it was

    def from_factors(self, source: Any, name: str, acc: Tensor, clip: Tensor, *,
                     out: Tensor | None = None) -> Tensor | None:
        """(numel,) float32 aggregate of tensor `name` from the source's LoRA factors (written into `out`,
        (numel,) float32, when given), or None."""
        return None

    def aggregate(self, x: Tensor, *, share: float) -> Tensor:
        """(numel,) aggregate of one tensor's clipped rows `x` (k, numel); `share`: its numel / the model's."""
        raise NotImplementedError

    def diagnostics(self) -> Diagnostics:
        """(k,) per contributor, over the whole model, once every tensor is aggregated."""
        raise NotImplementedError

    def absorb(self, part: Plan) -> None:
        """Add what `part`, a copy of this plan taken before any `aggregate`, gathered aggregating other
        tensors or row blocks (a sharded round: each block's `share` is its numel / the model's)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be sharded: it does not say how to absorb parts")


class LinearPlan(Plan):
    """sum_j coeff_j x_j / total (total None: sum_j coeff_j), the same coefficients for every tensor.
    Iterated rules also sum each row's squared distance to the aggregate: their reported score."""

    def __init__(self, coeff: Tensor, *, total: float | None = None, score: Tensor | None = None,
                 selected: Tensor | None = None, iterated: bool = False, factored: bool = False) -> None:
        k = coeff.numel()
        self.coeff, self.total, self.factored = coeff, total, factored
        self.score = torch.full((k,), float("nan"), dtype=torch.float64) if score is None else score
        self.selected = torch.ones(k, dtype=torch.bool) if selected is None else selected
        self.score_sq = torch.zeros(k, dtype=torch.float64) if iterated else None

    def from_factors(self, source: Any, name: str, acc: Tensor, clip: Tensor, *,
                     out: Tensor | None = None) -> Tensor | None:
        if not self.factored:
            return None
        return factored_mean(source, name, acc, clip, self.coeff, total=self.total, out=out)

    def aggregate(self, x: Tensor, *, share: float) -> Tensor:
        if self.score_sq is None:
            return combine(self.coeff, x, total=self.total)  # (numel,) combine64's numbers, x's dtype
        v = combine64(self.coeff, x, total=self.total)  # (numel,) float64
        self.score_sq += sq_distances_to(x, v)
        return v.to(x.dtype)

    def absorb(self, part: Plan) -> None:
        if self.score_sq is not None:
            self.score_sq += part.score_sq

    def diagnostics(self) -> Diagnostics:
        score = self.score if self.score_sq is None else self.score_sq.sqrt()
        used = self.coeff if self.total is None else self.coeff / self.total
        return Diagnostics(score=score, selected=self.selected, weight_used=used,
                           trimmed_share=(~self.selected).to(torch.float64))


class CoordinatewisePlan(Plan):
    """A per-tensor rule `fn(x) -> AggregateResult`; its diagnostics averaged over tensors by numel.
    `selects`: the rule's own `selected` is reported (else everybody counts as selected)."""

    def __init__(self, fn: Callable[[Tensor], AggregateResult], *, k: int, selects: bool = False,
                 note: str = "") -> None:
        self.fn, self.selects, self.note = fn, selects, note
        self.selected = torch.ones(k, dtype=torch.bool)
        self.trimmed = torch.zeros(k, dtype=torch.float64)
        self.used = torch.zeros(k, dtype=torch.float64)

    def aggregate(self, x: Tensor, *, share: float) -> Tensor:
        res = self.fn(x)
        self.trimmed += res.diagnostics.trimmed_share * share
        self.used += res.diagnostics.weight_used * share
        if self.selects:
            self.selected = res.diagnostics.selected
        return res.aggregate

    def absorb(self, part: Plan) -> None:
        self.trimmed += part.trimmed
        self.used += part.used
        if self.selects:
            self.selected = part.selected  # as `aggregate`: the last one's

    def diagnostics(self) -> Diagnostics:
        k = self.used.numel()
        return Diagnostics(score=torch.full((k,), float("nan"), dtype=torch.float64),
                           selected=self.selected, weight_used=self.used, trimmed_share=self.trimmed)


class Rule:
    """An aggregation rule: its settings are its dataclass fields (keyword-only), each named as the `SoupConfig`
    field (and so the flag) that sets it, and checked in the rule's __post_init__, the one place."""

    name: ClassVar[str]
    needs_distances: ClassVar[bool] = False      # the (k, k) whole-model distances: one more pass
    counts_copies_once: ClassVar[bool] = False   # the pipeline groups copies for it (krum.duplicate_groups)
    copies_only: ClassVar[bool] = False          # distances only to group copies: many rows group from a sketch
    iterated: ClassVar[bool] = False             # one pass over the model per iteration
    staleness_as_weights: ClassVar[bool] = False  # async: w(s) may be aggregation weights (else rows are scaled)
    dp_exact: ClassVar[bool] = False             # DP-FedAvg's sensitivity argument covers it (privacy.py)
    needs_reference: ClassVar[bool] = False      # a reference direction from the operator (DeltaSoup.run(reference=))

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The names of the rule's settings: its dataclass fields set at construction."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init) if dataclasses.is_dataclass(cls) else ()

    @classmethod
    def from_config(cls, config: Any) -> Rule:
        """The rule with each of its settings copied from the config's (a `SoupConfig`'s) field of that name
        (a setting the config lacks keeps the rule's default)."""
        return cls(**{name: getattr(config, name) for name in cls.settings() if hasattr(config, name)})

    def check_n(self, n: int) -> None:
        """Raise a ValueError (NotRobustConfigError) saying why `n` deltas are too few for this rule."""
        if n < 1:
            raise NotRobustConfigError("there is nothing to aggregate")

    def minimum_n(self) -> int:
        """The fewest deltas `check_n` accepts."""
        return 1

    def check_round(self, *, submitted: int, accepted: int) -> None:
        """Refuse a round before aggregating: by default on the contributions validation accepted."""
        self.check_n(accepted)

    def per_buffer(self, buffer_size: int) -> dict[str, Any]:
        """The settings an async flush of `buffer_size` deltas runs this rule with where they differ from a
        round's, by `SoupConfig` field name (recorded when the buffer closes); by default none."""
        return {}

    def plan(self, view: RoundView) -> Plan:
        raise NotImplementedError
