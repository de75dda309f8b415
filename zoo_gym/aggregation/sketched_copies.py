"""Copies among many rows without the (k, k) matrix: a CountSketch of each row, nearest neighbours in blocks.

`krum.duplicate_groups` reads every pairwise distance: k^2 x d work and a k x k float64 matrix (at k = 1000 on
the tiny base minutes of it; at 10,000, 800 MB and hours). Rules that use distances only to count copies once
(`Rule.copies_only`) take their groups from here above `EXACT_MAX` rows: each row's m-dimensional CountSketch
(per tensor a bucket and a sign per element, seeded by the tensor's name, so a redo draws the same), whose
squared distances keep the rows' within about sqrt(2/m) relative (Johnson-Lindenstrauss), then the same rule as
`duplicate_groups` (within DUPLICATE_SQ_DISTANCE x the median nonzero nearest squared distance, transitively,
each group named by its first row). Identical rows always group (identical sketches); a near-copy within
about a tenth of the threshold's edge may fall either side. Work k x d + k^2 x m, memory k x m + a block.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable

import numpy as np
import torch
from numba import njit
from torch import Tensor

from .krum import DUPLICATE_SQ_DISTANCE
from .packed_kernels import in_chunks

EXACT_MAX = 256  # up to this many rows the exact pairwise distances decide (krum.duplicate_groups)
SKETCH_DIMS = 256
_BLOCK_BYTES = 8 << 20  # distance rows (float64) computed at a time
_MIN_VALUES_PER_CHUNK = 1 << 20  # values sketched: below this a thread costs more than it saves


def _hashes(name: str, numel: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Element -> (bucket in [0, m), sign +-1) of tensor `name`, from a generator seeded by the name."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.integers(0, m, size=numel), (rng.integers(0, 2, size=numel) * 2 - 1).astype(np.float64)


@njit(nogil=True, cache=True)
def _sketch_rows(x, bucket, sign, r0, r1, out):
    """out[i, bucket[e]] += sign[e] * x[i, e] in float64 for rows [r0, r1) of x (k, numel), element by element in
    order: equal rows sketch equally. Compiled because numpy's gather-then-reduceat made copies of every row
    (about 10% of a 1,000-contributor round)."""
    for i in range(r0, r1):
        o, xi = out[i], x[i]
        for e in range(x.shape[1]):
            o[bucket[e]] += sign[e] * np.float64(xi[e])


def sketch(tensors: Iterable[tuple[str, Callable[[], Tensor]]], k: int, *, m: int = SKETCH_DIMS) -> np.ndarray:
    """(k, m) float64 CountSketch of k rows given tensor by tensor as (name, () -> (k, numel) rows)."""
    out = np.zeros((k, m))
    for name, rows in tensors:
        x = rows().detach().cpu()
        x = (x if x.dtype in (torch.float32, torch.float64) else x.float()).contiguous().numpy()  # (k, numel)
        bucket, sign = _hashes(name, x.shape[1], m)
        in_chunks(lambda r0, r1: _sketch_rows(x, bucket, sign, r0, r1, out), k,
                  min_chunk=_MIN_VALUES_PER_CHUNK // max(x.shape[1], 1))
    return out


def _first_equal(first: dict, s: np.ndarray, i: int) -> int:
    """The first row of `s` identical to row i, by a 16-byte digest checked against the rows themselves (keys of
    whole rows held 2 KB a contributor)."""
    j = first.setdefault(hashlib.blake2b(s[i].tobytes(), digest_size=16).digest(), i)
    return j if j == i or np.array_equal(s[j], s[i]) else i


def groups_from_sketch(s: np.ndarray) -> np.ndarray:
    """(k,) int64 each row's group, named by its first row, by `krum.duplicate_groups`' rule on the sketch."""
    k = s.shape[0]
    first = {}
    same = np.array([_first_equal(first, s, i) for i in range(k)])  # identical rows
    sq = (s * s).sum(axis=1)
    step = max(1, _BLOCK_BYTES // (8 * max(k, 1)))

    def block(i0: int) -> np.ndarray:  # (c, k) squared distances, 0 exactly between identical rows, inf to self
        d = np.maximum(sq[i0:i0 + step, None] + sq[None, :] - 2.0 * (s[i0:i0 + step] @ s.T), 0.0)
        d[same[i0:i0 + step, None] == same[None, :]] = 0.0
        d[np.arange(d.shape[0]), np.arange(i0, i0 + d.shape[0])] = np.inf
        return d

    nearest = np.concatenate([block(i0).min(axis=1) for i0 in range(0, k, step)]) if k > 1 else np.zeros(0)
    nearest = nearest[nearest > 0]
    tol = DUPLICATE_SQ_DISTANCE * float(np.median(nearest)) if nearest.size else 0.0
    pairs = [np.nonzero(block(i0) <= tol) for i0 in range(0, k, step)]
    left = np.concatenate([i + i0 for (i, _), i0 in zip(pairs, range(0, k, step))]) if pairs else np.zeros(0, int)
    right = np.concatenate([j for _, j in pairs]) if pairs else np.zeros(0, int)
    label = np.arange(k)
    for _ in range(k):  # connected components, each labelled by its smallest row
        before = label.copy()
        np.minimum.at(label, left, label[right])
        np.minimum.at(label, right, label[left])
        label = label[label]  # pointer jumping
        if np.array_equal(label, before):
            break
    return label.astype(np.int64)
