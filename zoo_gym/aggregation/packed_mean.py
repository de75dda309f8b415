"""Weighted mean of packed BitDelta deltas, without decoding each one to floats.

BitDelta (Liu et al., NeurIPS 2024, arXiv:2402.10193) codes contributor i's tensor as
``s_i[r, g] * (2 b_i - 1)``; Multi-Krum (Blanchard et al., NeurIPS 2017) averages the selected deltas:
``out = sum_i w_i s_i (2 b_i - 1)``. Runs one compiled kernel (`packed_kernels.weighted_sum`) over a
`PackedModel`, its ranges of groups shared among ``torch.get_num_threads()`` threads. Every output is
within (1.5 + m / 8) float32 eps of ``sum_i |w_i s_i|`` of the exact sum (m contributors of weight
> 0). Design: docs/design/aggregation.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from zoo_gym.codec.bitdelta import BitDeltaPacked

from .errors import AggregationError, InvalidDeltaError
from .packed_kernels import in_group_ranges, weighted_sum
from .packed_model import PackedModel

__all__ = ["model_mean", "packed_mean"]

_MIN_TERMS_PER_THREAD = 1 << 23  # element x contributor terms (about 0.7 ms) worth waking a thread


def _normalised(weights: Sequence[float] | None, n: int) -> np.ndarray:
    """float64 (n,) weights summing to 1 (uniform when None); refuses bad weights by name."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.shape != (n,):
        raise AggregationError(f"`weights` has {w.shape[0]} entries for {n} packed deltas; give one per delta")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise AggregationError(f"`weights` must be finite, >= 0 and not all zero, got {w.tolist()}")
    return w / w.sum()


def _run(model: PackedModel, rows: np.ndarray, w: np.ndarray, g0: int, g1: int, out: np.ndarray) -> None:
    """Fill out (flat float32, one value per sign bit) for groups g0..g1."""
    wb = model.word_bytes
    ends = np.append(model.starts, model.words.shape[1]) * wb  # (G + 1,) in bytes
    weighted_sum(model.words.view(np.uint8), model.scales, rows, w, ends, g0, g1, out)


def model_mean(model: PackedModel, *, weights: Sequence[float] | None = None,
               threads: int | None = None) -> list[Tensor]:
    """Per-tensor float32 sum_i w_i * scale_i * sign_i over the contributors of `model`.

    Weights are normalised (uniform when None); contributors of weight 0 cost nothing, so a
    Multi-Krum average passes the model built for distances with zeros for the unselected.
    Returns one tensor per packed tensor, shaped like it (views into one flat buffer where the
    layout has no padding inside rows).
    """
    n = model.words.shape[0]
    w = _normalised(weights, n)
    rows = np.flatnonzero(w > 0)
    pad = -len(rows) % 4  # the kernel adds contributors four at a time: pad with weight 0
    rows = np.concatenate([rows, np.full(pad, rows[0])]).astype(np.int64)
    wq = np.concatenate([w[rows[:len(rows) - pad]], np.zeros(pad)])
    # numpy's allocator asks for transparent huge pages on large buffers (torch's does not): a
    # server's next round reuses the freed huge pages, 512x fewer page faults on 100M outputs
    flat = torch.from_numpy(np.empty(model.words.shape[1] * model.word_bytes * 8, dtype=np.float32))
    if threads is None:  # small models: handing work to a thread costs more than it saves
        threads = min(torch.get_num_threads(), flat.numel() * len(rows) // _MIN_TERMS_PER_THREAD)
    out = flat.numpy()
    in_group_ranges(lambda g0, g1: _run(model, rows, wq, g0, g1, out), model.counts.shape[0], threads)
    return model.split(flat)


def _check(packed: Sequence[BitDeltaPacked]) -> None:
    """Refuse an empty list and layouts that disagree, naming the first bad entry."""
    if len(packed) == 0:
        raise AggregationError("`packed` is empty: pass at least one BitDeltaPacked to average")
    p0 = packed[0]
    nbytes = -(-p0.cols // 8)
    for i, p in enumerate(packed):
        if (p.rows, p.cols, p.group_size) != (p0.rows, p0.cols, p0.group_size):
            raise InvalidDeltaError(
                f"`packed[{i}]` has layout rows={p.rows} cols={p.cols} group_size={p.group_size}, "
                f"but `packed[0]` has rows={p0.rows} cols={p0.cols} group_size={p0.group_size}; "
                "all contributors must be coded with the same layout")
        if p.signs.dtype != torch.uint8 or tuple(p.signs.shape) != (p.rows, nbytes):
            raise InvalidDeltaError(
                f"`packed[{i}].signs` must be uint8 ({p.rows}, {nbytes}), got "
                f"{p.signs.dtype} {tuple(p.signs.shape)}")


def packed_mean(packed: Sequence[BitDeltaPacked], *, weights: Sequence[float] | None = None) -> Tensor:
    """float32 (rows, cols) = sum_i w_i * scale_i * sign_i, weights normalised (uniform when None).

    Every delta must share rows, cols and group_size. Matches averaging the decoded deltas
    (`BitDeltaPacked.to_dense`) to within float32 rounding (see the module docstring).
    """
    _check(packed)
    w = _normalised(weights, len(packed))
    p0 = packed[0]
    if p0.rows * p0.cols == 0:
        return torch.empty((p0.rows, p0.cols), dtype=torch.float32)
    model = PackedModel.build([[p] for p in packed])
    return model_mean(model, weights=w).pop(0).reshape(p0.rows, p0.cols)
