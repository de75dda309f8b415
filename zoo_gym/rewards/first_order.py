"""First-order (linearised) losses: score a round from one gradient instead of n + k forward passes.

With ``g`` the gradient of the validation loss at the base checkpoint, to first order

    L_i  ~= L0 + <g, delta_i>                                   (solo loss, ``slope_i = <g, delta_i>``)
    L(S) ~= L0 + sum_{i in S} w_i slope_i / sum_{i in S} w_i    (the aggregator's weights w, restricted)

FLTrust's idea (Cao et al., NDSS 2021) stated as a loss change. It ignores curvature: keep the norm
bound / DP clipping on. Why it scores attacks 0: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from numba import njit
from torch import Tensor

from zoo_gym.evaluation.spill import SpilledTensors, read_ahead

from .errors import ScoringInputError


def directional_slopes(grad: Mapping[str, Tensor],
                       deltas: Sequence[Mapping[str, Tensor]]) -> list[float]:
    """``<g, delta_i>`` for every delta (float64 accumulation); tensors missing from a delta count 0."""
    out = []
    for i, d in enumerate(deltas):
        total = torch.zeros((), dtype=torch.float64)
        for name, t in d.items():
            g = grad.get(name)
            if g is None:
                raise ScoringInputError(f"delta {i} has tensor {name!r} that the gradient lacks")
            if g.numel() != t.numel():
                raise ScoringInputError(f"delta {i} tensor {name!r} has {t.numel()} values, the "
                                        f"gradient {g.numel()}")
            total += torch.dot(g.reshape(-1).to(torch.float64), t.reshape(-1).to(torch.float64))
        out.append(float(total))
    return out


def linear_losses(*, base_loss: float, slopes: Sequence[float], weights: Sequence[float]
                  ) -> tuple[list[float], Callable[[frozenset[int]], float]]:
    """(solo_losses, subset_loss) of the linearised game, ready for `score_round`."""
    if len(slopes) != len(weights):
        raise ScoringInputError(f"`slopes` ({len(slopes)}) and `weights` ({len(weights)}) must "
                                "have the same length")
    solo = [base_loss + float(s) for s in slopes]

    def subset_loss(subset: frozenset[int]) -> float:
        tw = sum(float(weights[i]) for i in subset)
        if tw <= 0:
            return base_loss
        return base_loss + sum(float(weights[i]) * float(slopes[i]) for i in subset) / tw

    return solo, subset_loss


class DeltaRows(Protocol):
    """What `streamed_slopes` reads: the aggregation's ``DeltaSource`` (one tensor at a time)."""

    def names(self) -> Sequence[str]: ...

    def stacked(self, name: str) -> Tensor: ...  # (n, numel) float32


def _gradient_of(grad: Mapping[str, Tensor], name: str, numel: int) -> Tensor:
    """The gradient of tensor `name`, refused by name when it is missing or of another size."""
    g = grad.get(name)
    if g is None:
        raise ScoringInputError(f"the deltas have tensor {name!r} that the gradient lacks: "
                                "compute the gradient on the round's base checkpoint")
    if g.numel() != numel:
        raise ScoringInputError(f"tensor {name!r} has {numel} values in the deltas, "
                                f"{g.numel()} in the gradient")
    return g


@njit(nogil=True, cache=True)
def _dot_and_square(x, g, s, q):
    """s[i] += sum_c x[i, c] g[c] and q[i] += sum_c x[i, c]^2, in float64: four partial sums per row (columns c mod
    4) added in that order at the end, a fixed order on every CPU (no fastmath, no fused multiply-add). Compiled
    because the torch version upcast every row block to float64 first, a temporary as large as the block (CHANGELOG
    has what it cost)."""
    m = x.shape[1]
    for i in range(x.shape[0]):
        a0 = a1 = a2 = a3 = 0.0
        b0 = b1 = b2 = b3 = 0.0
        c = 0
        while c + 3 < m:
            v0, v1 = np.float64(x[i, c]), np.float64(x[i, c + 1])
            v2, v3 = np.float64(x[i, c + 2]), np.float64(x[i, c + 3])
            a0 += v0 * g[c]
            a1 += v1 * g[c + 1]
            a2 += v2 * g[c + 2]
            a3 += v3 * g[c + 3]
            b0 += v0 * v0
            b1 += v1 * v1
            b2 += v2 * v2
            b3 += v3 * v3
            c += 4
        while c < m:
            v0 = np.float64(x[i, c])
            a0 += v0 * g[c]
            b0 += v0 * v0
            c += 1
        s[i] += (a0 + a1) + (a2 + a3)
        q[i] += (b0 + b1) + (b2 + b3)


def _row_sums(rows: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows @ g, |rows|^2 per row)`` in float64; rows ``(n, numel)``, g any shape of numel. One read of the
    rows (`_dot_and_square`), nothing allocated beyond g in float64."""
    n = rows.shape[0]
    x = rows.detach()
    x = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    x = (x if x.is_contiguous() else x.contiguous()).numpy()
    s = np.zeros(n)
    q = np.zeros(n)
    _dot_and_square(x, np.ascontiguousarray(g.reshape(-1).to(torch.float64).numpy()), s, q)
    return torch.from_numpy(s), torch.from_numpy(q)


_BLOCK_BYTES = 4 << 20  # float32 gradient rows upcast and multiplied at a time (_factor_slopes)


def _factor_slopes(g: Tensor, b: Tensor, a: Tensor) -> Tensor:
    """(R,) float64: entry k is sum_{o, j} g[o, j] b[o, k] a[k, j], so <g, B_i A_i> sums contributor i's ranks.

    Taken as sum_o b[o, k] (g a^T)[o, k], a block of rows of g at a time: g (out, in) in any float dtype (a
    block upcast to float32 at a time, no whole float32 copy), b (out, R) and a (R, in) float32. The
    float32 product g a^T reads g once in its own layout; the products sum in float64."""
    out, inn = g.shape
    at = a.T.contiguous()  # (in, R)
    total = torch.zeros(a.shape[0], dtype=torch.float64)
    step = max(1, _BLOCK_BYTES // (4 * max(inn, 1)))
    for o0 in range(0, out, step):
        ga = g[o0:o0 + step].float() @ at  # (rows, R)
        total += (ga * b[o0:o0 + step]).sum(dim=0, dtype=torch.float64)
    return total


def streamed_slopes(grad: Mapping[str, Tensor], source: DeltaRows, *, scales: Sequence[float]
                    ) -> tuple[list[float], list[float]]:
    """``(slopes, norms)``: ``scales[i] * <g, delta_i>`` and ``scales[i] * ||delta_i||`` of every row.

    Reads ``source`` one tensor at a time (memory: one tensor x n, like the aggregation), one
    matrix-vector product per tensor, float64 accumulation. ``scales`` are the clip factors the
    aggregator applied (1.0 for none). A tensor the gradient lacks is an error (wrong base).
    """
    slopes: Tensor | None = None  # (n,) float64
    sq: Tensor | None = None      # (n,) float64
    for name in source.names():
        rows = source.stacked(name)                                       # (n, numel)
        g = _gradient_of(grad, name, rows.shape[1])
        if len(scales) != rows.shape[0]:
            raise ScoringInputError(f"`scales` has {len(scales)} entries for {rows.shape[0]} deltas")
        s, q = _row_sums(rows, g)                                         # (n,), (n,)
        slopes = s if slopes is None else slopes + s
        sq = q if sq is None else sq + q
    if slopes is None or sq is None:
        return [0.0] * len(scales), [0.0] * len(scales)
    sc = torch.tensor([float(c) for c in scales], dtype=torch.float64)   # (n,)
    return (slopes * sc).tolist(), (sq.sqrt() * sc.abs()).tolist()


SHAPLEY_BYTES = 32 << 20  # linear_shapley's temporaries per block of permutations


def linear_shapley(gains: Sequence[float], weights: Sequence[float], *, permutations: int,
                   generator: torch.Generator) -> tuple[list[float], int, bool]:
    """Shapley values of the weighted-mean game ``V(S) = sum_S w_i a_i / sum_S w_i`` (``V = 0``
    when ``sum_S w = 0``), the first-order GTG game with ``a_i`` the linearised solo gains.

    Returns ``(phi, permutations_used, exact)``. Every evaluation is arithmetic, so there is no
    truncation: when ``n! <= permutations`` all permutations are enumerated (exact); otherwise
    ``permutations`` are sampled, the ``k``-th led by player ``k mod n`` (GTG's guided sampling),
    the rest in random order, as tensors of ``SHAPLEY_BYTES`` at a time (the same draws and sums as all at
    once; at 10,000 contributors all at once was 1.3 GB). Every permutation telescopes, so
    ``sum_i phi_i = V(N)`` up to rounding (efficiency) either way. Cost: O(permutations x n).
    """
    n = len(gains)
    if len(weights) != n:
        raise ScoringInputError(f"`gains` ({n}) and `weights` ({len(weights)}) must have the "
                                "same length")
    if permutations < 1:
        raise ScoringInputError(f"`permutations` must be >= 1, got {permutations}")
    if n == 0:
        return [], 0, True
    a = torch.tensor([float(x) for x in gains], dtype=torch.float64)      # (n,)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)    # (n,)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ScoringInputError("`gains` must be finite and `weights` finite and >= 0")
    exact = math.factorial(n) <= permutations
    everything = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long) if exact else None
    used = everything.shape[0] if exact else permutations
    phi = torch.zeros(n, dtype=torch.float64)
    step = max(1, SHAPLEY_BYTES // (64 * n))  # permutations at a time: ~8 float64 / int64 (c, n) temporaries
    for p0 in range(0, used, step):  # the same draws and the same sums, in order, as all at once
        c = min(step, used - p0)
        if exact:
            orders = everything[p0:p0 + c]                                               # (c, n)
        else:
            keys = torch.rand((c, n), generator=generator, dtype=torch.float64)          # (c, n)
            keys[torch.arange(c), torch.arange(p0, p0 + c) % n] = -1.0  # guided lead
            orders = keys.argsort(dim=1)                                                 # (c, n)
        cw = w[orders].cumsum(dim=1)                                      # (c, n)
        cwa = (w * a)[orders].cumsum(dim=1)                               # (c, n)
        v = torch.where(cw > 0, cwa / cw.clamp_min(1e-300), torch.zeros_like(cw))  # (c, n) V(prefix)
        marg = torch.diff(v, dim=1, prepend=torch.zeros(v.shape[0], 1, dtype=v.dtype))  # (c, n)
        phi.index_add_(0, orders.reshape(-1), marg.reshape(-1))
    return (phi / used).tolist(), used, exact


class SlopeTap:
    """A ``DeltaSource`` proxy that computes slopes from the rows the aggregation decodes anyway.

    Wrap the server's source before ``DeltaSoup.run(SlopeTap(source, grad), ...)``; the first
    ``stacked(name)`` of every tensor also adds ``rows @ g[name]`` and ``|rows|^2`` to per-row
    sums (one matrix-vector product: no second decode of the payloads, no extra memory beyond one
    tensor x n). Afterwards ``result(scales=clip_factors)`` equals
    ``streamed_slopes(grad, source, scales=...)``. ``seconds`` is the time the tap itself added.
    Everything else (``names``, ``shape``, ``packed``, ``contributors`` ...) is passed through.

    ``keep_bytes``: the tap keeps references to the rows it saw, up to this many bytes, so that
    ``delta_of(i)`` (the exact checks' dense delta) reads them instead of decoding contributor
    ``i`` again. A source that caches its decoded rows (the server's ``StoredDeltas`` does, up to
    its own budget) and says so (``cached(name)``) costs no extra memory: only its cached tensors are
    kept, never rows it decoded for one pass (up to ``keep_bytes`` more held all round: issue 51).
    """

    def __init__(self, source: DeltaRows, grad: Mapping[str, Tensor], *, keep_bytes: int = 0) -> None:
        if keep_bytes < 0:
            raise ScoringInputError(f"`keep_bytes` must be >= 0, got {keep_bytes}")
        self._source = source
        self._grad = grad
        # a spilled gradient is read in the aggregation's order, the next tensor on a thread (spill.read_ahead)
        self._reader = read_ahead(grad, source.names()) if isinstance(grad, SpilledTensors) else None
        self._kept: dict[str, Tensor] = {}
        self._keep_left = keep_bytes
        self._seen: set[str] = set()
        self._blocks: dict[str, dict[int, int]] = {}  # tensors read in blocks: start -> elements, slopes taken
        self._block_grad: tuple[str, Tensor] | None = None  # the gradient of the tensor being read in blocks
        self._slopes: Tensor | None = None  # (n,) float64
        self._sq: Tensor | None = None      # (n,) float64
        self.seconds = 0.0

    def __getattr__(self, attr: str):  # only called for attributes SlopeTap lacks
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._source, attr)

    def names(self) -> Sequence[str]:
        return self._source.names()

    def factors(self, name: str) -> Sequence | None:
        """The source's LoRA factors of `name` (zoo_gym/aggregation/lora_mean.py: the plain mean then
        decodes no row), with the slopes taken from them: <g, B A> = sum((g A^T) * B), every
        contributor's g A^T in one float32 matmul (`_factor_slopes`: one read of the gradient; the float32
        products sum over `in` terms, ~1e-6 of |B A| |g|), and |B A|^2 the source's `sq_norms` (validation's, from the
        r x r Gram matrices), never forming an (out, in) product. None (rows are decoded, and tapped)
        when the source has no factors or no norms for them."""
        inner = getattr(self._source, "factors", None)
        factors = inner(name) if inner is not None else None
        if factors is None or name in self._seen:
            return factors
        norms = getattr(self._source, "sq_norms", None)
        known = norms(name) if norms is not None else None
        if known is None:
            return None
        t = time.perf_counter()
        shape = tuple(self._source.shape(name))
        s = torch.zeros(len(factors), dtype=torch.float64)  # (n,)
        q = known[0].to(torch.float64).clone()  # (n,)
        sent = [i for i, f in enumerate(factors) if f is not None]  # the others are zero rows
        if sent:
            g = self._gradient(name, math.prod(shape)).reshape(shape)  # (out, in), float32 or as spilled
            ranks = [factors[i].A.shape[0] for i in sent]
            per_rank = _factor_slopes(g, torch.cat([factors[i].B.float() for i in sent], dim=1),
                                      torch.cat([factors[i].A.float() for i in sent], dim=0))
            for i, part in zip(sent, per_rank.split(ranks)):
                s[i] = float(part.sum())
        self._slopes = s if self._slopes is None else self._slopes + s
        self._sq = q if self._sq is None else self._sq + q
        self._seen.add(name)
        self.seconds += time.perf_counter() - t
        return factors

    def seen(self, name: str) -> bool:
        """Whether the slopes of tensor `name` are taken (a sharded aggregation shows the tap what it has not)."""
        return name in self._seen

    def stacked(self, name: str) -> Tensor:
        rows = self._source.stacked(name)                                 # (n, numel)
        if name not in self._seen:
            t = time.perf_counter()
            g = self._gradient(name, rows.shape[1])
            s, q = _row_sums(rows, g)                                     # (n,), (n,)
            self._slopes = s if self._slopes is None else self._slopes + s
            self._sq = q if self._sq is None else self._sq + q
            self._seen.add(name)
            cached = getattr(self._source, "cached", None)  # a source that says which rows it keeps anyway
            if rows.nbytes <= self._keep_left and (cached is None or cached(name)):
                self._kept[name] = rows
                self._keep_left -= rows.nbytes
            self.seconds += time.perf_counter() - t
        return rows

    @property
    def reads_blocks(self) -> bool:
        """Whether the wrapped source reads a tensor a block of rows at a time (`stacked_block`)."""
        return getattr(self._source, "stacked_block", None) is not None and getattr(self._source, "reads_blocks", True)

    def stacked_block(self, name: str, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        """The source's `stacked_block`; the first read of each block of a tensor adds its share of the slopes
        (the tensor is seen once its blocks cover it). Nothing is kept for the exact checks (`delta_of` decodes)."""
        rows = self._source.stacked_block(name, start, stop, out=out)       # (n, stop - start)
        if name in self._seen:
            return rows
        taken = self._blocks.setdefault(name, {})
        if start not in taken:
            t = time.perf_counter()
            if self._block_grad is None or self._block_grad[0] != name:
                numel = math.prod(self._source.shape(name))
                self._block_grad = (name, self._gradient(name, numel).reshape(-1))
            s, q = _row_sums(rows, self._block_grad[1][start:stop])
            self._slopes = s if self._slopes is None else self._slopes + s
            self._sq = q if self._sq is None else self._sq + q
            taken[start] = stop - start
            if sum(taken.values()) == math.prod(self._source.shape(name)):
                self._seen.add(name)
                self._block_grad = None
            self.seconds += time.perf_counter() - t
        return rows

    def _gradient(self, name: str, numel: int) -> Tensor:
        """The gradient of tensor `name` (spilled: as stored, read ahead), refused as `_gradient_of` does."""
        if self._reader is None or name not in self._grad or self._grad.shape(name).numel() != numel:
            return _gradient_of(self._grad, name, numel)  # a dict's gradient, or the error naming what is wrong
        return self._reader.get(name)

    def delta_of(self, i: int) -> "LazyDelta":
        """Contributor ``i``'s dense delta (unscaled), every tensor in the gradient's shape, as a
        mapping that builds a tensor when it is read (``delta[name]``): a view of the kept rows, or
        from the source (``stacked_one`` when it has one). ``PackedScoringSet.loss`` reads one
        tensor at a time, so the whole dense delta never exists at once."""
        return LazyDelta(self, i)

    def _tensor_of(self, i: int, name: str) -> Tensor:
        shape = self._grad.shape(name) if isinstance(self._grad, SpilledTensors) else self._grad[name].shape
        rows = self._kept.get(name)
        if rows is not None:
            return rows[i].reshape(shape)
        if hasattr(self._source, "stacked_one"):
            return self._source.stacked_one(i, name).reshape(shape)
        return self._source.stacked(name)[i].reshape(shape)

    def result(self, *, scales: Sequence[float]) -> tuple[list[float], list[float]]:
        """``(slopes, norms)`` scaled by ``scales`` (clip factors); every tensor must be seen."""
        missing = [k for k in self._source.names() if k not in self._seen]
        if missing:
            raise ScoringInputError(f"the aggregation never read {len(missing)} tensor(s) "
                                    f"(first: {missing[0]!r}); call result() after DeltaSoup.run")
        if self._slopes is None or self._sq is None:
            return [0.0] * len(scales), [0.0] * len(scales)
        if len(scales) != self._slopes.shape[0]:
            raise ScoringInputError(f"`scales` has {len(scales)} entries for "
                                    f"{self._slopes.shape[0]} deltas")
        sc = torch.tensor([float(c) for c in scales], dtype=torch.float64)  # (n,)
        return (self._slopes * sc).tolist(), (self._sq.sqrt() * sc.abs()).tolist()


class LazyDelta(Mapping[str, Tensor]):
    """One contributor's dense delta (``SlopeTap.delta_of``), each tensor built when it is read.

    Keys are the source's tensor names; nothing is cached, so a reader that drops each tensor after
    use holds one tensor at a time."""

    def __init__(self, tap: SlopeTap, i: int) -> None:
        self._tap, self._i = tap, i
        self._names = dict.fromkeys(tap.names())  # ordered, O(1) membership

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._tap._tensor_of(self._i, name)  # noqa: SLF001 - the tap's own reader

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
