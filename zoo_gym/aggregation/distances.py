"""Accurate pairwise squared distances between deltas, dense or straight from BitDelta bits.

Flower's Krum computes ||x||^2 + ||y||^2 - 2 x.y in float32 on full weights; when deltas are
small against the weights, the three terms are huge and nearly cancel, and the result is off by
percents. Here we (1) work on deltas, (2) centre each column chunk by its contributor mean
(distances are translation invariant, so this is exact maths and removes the common part),
(3) accumulate in float64, and (4) set the diagonal exactly to 0.

Compressed domain (BitDelta, Liu et al. 2024, arXiv:2402.10193): inside a group of c elements
with scales sx, sy where k signs differ,
    ||x - y||^2 = (c - k)(sx - sy)^2 + k(sx + sy)^2 = c(sx - sy)^2 + 4 k sx sy,
and k is a popcount of the XOR of the packed sign bytes. Both terms are >= 0, so the float64
sum has no cancellation. No decoding to float32 happens.

Speed: groups start on byte boundaries, so the sign bytes of every tensor of one contributor
can be laid end to end into ONE word vector (each group zero-padded to whole words; a zero pad
XORs to 0, so this is exact). All pairs are then done per cache-sized chunk of groups with one
XOR + popcount per contributor row and a segment sum over groups (`PackedModel`), instead of
Python work per tensor and per pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_deltas
from .errors import InvalidDeltaError

_CHUNK = 1 << 16  # columns per float64 chunk: (n, 65536) float64 = n * 512 KiB
_CHUNK_WORDS = 1 << 14  # packed words per contributor per chunk: 16384 x 8 B = 128 KiB
_MAX_PAD = 1.25  # accept zero padding up to 25 % more sign bytes for a simpler word layout
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def pairwise_sq_distances(deltas: Tensor) -> Tensor:
    """(n, n) float64 squared L2 distances between the rows of `deltas` (n, d); diagonal exactly 0."""
    deltas = check_deltas(deltas)
    n, d = deltas.shape
    out = torch.zeros((n, n), dtype=torch.float64)
    for start in range(0, d, _CHUNK):
        x = deltas[:, start:start + _CHUNK].to(torch.float64)  # (n, c)
        x = x - x.mean(dim=0, keepdim=True)                      # centred: exact, removes shared part
        sq = (x * x).sum(dim=1)                                   # (n,)
        out += sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    out.clamp_(min=0.0)
    out.fill_diagonal_(0.0)
    return out


# ---- layout checks -----------------------------------------------------------------------------
def _layout(p: Any) -> tuple[int, int, int, tuple[int, ...]]:
    return (p.rows, p.cols, p.group_size, tuple(p.scales.shape))


def _check_one(p: Any, *, where: str) -> None:
    if p.scales.dim() != 2 or p.scales.shape[0] not in (1, p.rows):
        raise InvalidDeltaError(f"`{where}.scales` must have {p.rows} or 1 rows, got "
                                f"{tuple(p.scales.shape)}")
    if p.signs.dtype != torch.uint8:
        raise InvalidDeltaError(f"`{where}.signs` must be uint8, got {p.signs.dtype}")
    nbytes = -(-p.cols // 8)
    if tuple(p.signs.shape) != (p.rows, nbytes):
        raise InvalidDeltaError(f"`{where}.signs` must be shaped ({p.rows}, {nbytes}) for "
                                f"rows={p.rows} cols={p.cols}, got {tuple(p.signs.shape)}")
    if p.scales.shape[1] > 1 and p.group_size % 8 != 0:
        raise InvalidDeltaError(f"`{where}` has group_size={p.group_size}: it must be a multiple of "
                                "8 when a row has several groups (groups must start on a byte)")


def _check_models(models: Sequence[Sequence[Any]]) -> int:
    """Refuse empty input, ragged tensor lists and differing layouts; returns the tensor count."""
    if len(models) == 0:
        raise InvalidDeltaError("no contributors: need at least one list of BitDeltaPacked")
    n_t = len(models[0])
    if n_t == 0:
        raise InvalidDeltaError("`models[0]` has no tensors: need at least one BitDeltaPacked")
    for i, m in enumerate(models):
        if len(m) != n_t:
            raise InvalidDeltaError(f"contributor {i} has {len(m)} packed tensors, contributor 0 has "
                                    f"{n_t}; pass the same tensors in the same order for everyone")
    for t in range(n_t):
        ref = _layout(models[0][t])
        for i, m in enumerate(models):
            p = m[t]
            if _layout(p) != ref:
                raise InvalidDeltaError(
                    f"contributor {i} tensor {t} has layout rows={p.rows} cols={p.cols} "
                    f"group_size={p.group_size} scales={tuple(p.scales.shape)}, but contributor 0 "
                    f"has {ref}; compressed-domain distances need identical layouts (decode and "
                    "use pairwise_sq_distances instead)")
            _check_one(p, where=f"models[{i}][{t}]")
    return n_t


# ---- whole-model packed vector -----------------------------------------------------------------
def _group_bytes(p: Any) -> tuple[int, int, int, int]:
    """(n_groups, bytes of a full group, full groups per row, bytes of the last group)."""
    n_groups = int(p.scales.shape[1])
    nbytes = -(-p.cols // 8)
    gb = nbytes if n_groups == 1 else p.group_size // 8
    last = nbytes - gb * (n_groups - 1)
    return n_groups, gb, n_groups - 1, last


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class PackedModel:
    """Several BitDelta tensors of n contributors laid end to end, group by group.

    words:       (n, n_words) uint8/16/32/64 sign bits; each group zero-padded to whole words
    scales:      (n, n_groups) float64 per-group scales (times any per-contributor multiplier)
    counts:      (n_groups,) float64 real elements per group
    starts:      (n_groups,) int64 first word of each group
    group_words: words in every group when all groups have the same padded length, else 0
    """

    words: np.ndarray
    scales: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    group_words: int

    @classmethod
    def build(cls, models: Sequence[Sequence[Any]], *, scale: Tensor | None = None) -> PackedModel:
        """`models[i]`: contributor i's BitDeltaPacked tensors (same order and layouts for all);
        `scale`: optional (n,) multipliers folded into contributor i's scales (e.g. clip factors)."""
        n_t = _check_models(models)
        n = len(models)
        mult = np.ones(n) if scale is None else torch.as_tensor(scale, dtype=torch.float64).numpy()
        if mult.shape != (n,):
            raise InvalidDeltaError(f"`scale` must have one entry per contributor ({n}), got "
                                    f"{tuple(mult.shape)}")
        shapes = [_group_bytes(models[0][t]) for t in range(n_t)]
        rows = [models[0][t].rows for t in range(n_t)]
        lengths = {b for (g, gb, full, last) in shapes for b in ((gb, last) if full else (last,))}
        raw = sum(r * (gb * full + last) for r, (g, gb, full, last) in zip(rows, shapes))
        n_groups = sum(r * g for r, (g, *_rest) in zip(rows, shapes))
        # widest word whose zero padding stays within _MAX_PAD; then uniform groups if cheap
        word = 1
        for w in (8, 4, 2):
            padded = sum(r * (_round_up(gb, w) * full + _round_up(last, w))
                         for r, (g, gb, full, last) in zip(rows, shapes))
            if padded <= _MAX_PAD * raw:
                word = w
                break
        widest = max(_round_up(b, word) for b in lengths)
        uniform = n_groups * widest <= _MAX_PAD * raw or len({_round_up(b, word) for b in lengths}) == 1
        # per tensor: padded bytes of a full group and of the last group
        pads = [((widest, widest) if uniform else (_round_up(gb, word), _round_up(last, word)))
                for (g, gb, full, last) in shapes]
        total = sum(r * (pf * full + pl) for r, (g, gb, full, last), (pf, pl) in zip(rows, shapes, pads))
        buf = np.zeros((n, total), dtype=np.uint8)           # (n, padded bytes)
        scales = np.empty((n, n_groups), dtype=np.float64)  # (n, G)
        counts = np.empty(n_groups, dtype=np.float64)        # (G,)
        starts = np.empty(n_groups, dtype=np.int64)          # (G,) in bytes, then words
        pos = gpos = 0
        for t, ((g, gb, full, last), (pf, pl), r) in enumerate(zip(shapes, pads, rows)):
            row_bytes = pf * full + pl
            region = buf[:, pos:pos + r * row_bytes].reshape(n, r, row_bytes)  # (n, r, row_bytes)
            offs = np.concatenate([np.arange(full) * pf, [pf * full]])  # (g,) group offsets in a row
            starts[gpos:gpos + r * g] = (pos + np.arange(r)[:, None] * row_bytes + offs).ravel()
            counts[gpos:gpos + r * g] = np.tile(models[0][t].group_counts().numpy(), r)
            for i in range(n):
                p = models[i][t]
                signs = p.signs.numpy()  # (r, nbytes)
                if full and pf == gb:  # no padding inside the row: one 2-D copy
                    region[i, :, :gb * full] = signs[:, :gb * full]
                elif full:
                    region[i, :, :pf * full].reshape(r, full, pf)[:, :, :gb] = \
                        signs[:, :gb * full].reshape(r, full, gb)
                region[i, :, pf * full:pf * full + last] = signs[:, gb * full:]
                np.multiply(p.scales.numpy(), mult[i],  # (1 | r, g) float32 -> float64
                            out=scales[i, gpos:gpos + r * g].reshape(r, g))
            pos += r * row_bytes
            gpos += r * g
        return cls(words=buf.view(_WORD[word]), scales=scales, counts=counts,
                   starts=starts // word, group_words=widest // word if uniform else 0)

    def sq_distances(self) -> np.ndarray:
        """(n, n) float64 squared distances, diagonal exactly 0."""
        n, n_words = self.words.shape
        n_groups = self.counts.shape[0]
        out = np.zeros((n, n), dtype=np.float64)
        if n == 1:
            return out
        gw = self.group_words
        if gw:
            step = max(1, _CHUNK_WORDS // gw)
            bounds = list(range(0, n_groups, step)) + [n_groups]
        else:  # cut at group starts, about _CHUNK_WORDS words apart
            marks = np.searchsorted(self.starts, np.arange(0, n_words, _CHUNK_WORDS))
            bounds = sorted(set(marks.tolist()) | {0, n_groups})
        ends = np.append(self.starts, n_words)                         # (G + 1,)
        b = np.asarray(bounds)
        cw_max = int((ends[b[1:]] - ends[b[:-1]]).max())               # widest chunk, words
        gc_max = int(np.diff(b).max())                                 # most groups in a chunk
        xor = np.empty((n - 1, cw_max), dtype=self.words.dtype)        # scratch (n-1, cw)
        bits = np.empty((n - 1, cw_max), dtype=np.uint8)               # popcount per word
        k16 = np.empty((n - 1, gc_max), dtype=np.int16)                # differing signs per group
        f = np.empty((n - 1, gc_max), dtype=np.float64)                # float64 scratch
        for g0, g1 in zip(bounds[:-1], bounds[1:]):
            w0, w1 = int(ends[g0]), int(ends[g1])
            cw, gc = w1 - w0, g1 - g0
            block = self.words[:, w0:w1]              # (n, cw)
            s = self.scales[:, g0:g1]                 # (n, gc)
            c = self.counts[g0:g1]                    # (gc,)
            local = None if gw else self.starts[g0:g1] - w0
            for i in range(n - 1):
                m = n - 1 - i
                x = np.bitwise_xor(block[i], block[i + 1:], out=xor[:m, :cw])      # (m, cw)
                pc = np.bitwise_count(x, out=bits[:m, :cw])                         # (m, cw)
                if gw == 1:
                    k = pc                                                          # (m, gc)
                elif 1 < gw <= 8:  # strided adds: a reduction over a short axis is slow in numpy
                    k = np.add(pc[:, 0::gw], pc[:, 1::gw], out=k16[:m, :gc], dtype=np.int16)
                    for j in range(2, gw):
                        np.add(k, pc[:, j::gw], out=k)
                elif gw:
                    k = pc.reshape(m, gc, gw).sum(axis=-1, dtype=np.int32)          # (m, gc)
                else:
                    k = np.add.reduceat(pc, local, axis=1, dtype=np.int32)         # (m, gc)
                si, sj = s[i], s[i + 1:]                                             # (gc,), (m, gc)
                y = np.multiply(k, sj, out=f[:m, :gc])                               # (m, gc)
                out[i, i + 1:] += 4.0 * (y @ si)                                     # (m,)
        out += out.T
        out += self._scale_term()
        np.fill_diagonal(out, 0.0)
        return out


    def _scale_term(self) -> np.ndarray:
        """(n, n) sum over groups of c (s_i - s_j)^2: a Gram matrix of the centred, sqrt(c)-weighted
        scales (BLAS), chunk by chunk; pairs where that cancels badly are redone directly."""
        n, n_groups = self.scales.shape
        gram = np.zeros((n, n))
        for g0 in range(0, n_groups, _CHUNK):
            t = self.scales[:, g0:g0 + _CHUNK]                           # (n, gc)
            t = (t - t.mean(axis=0)) * np.sqrt(self.counts[g0:g0 + _CHUNK])  # centred: exact maths
            gram += t @ t.T
        sq = np.diag(gram).copy()                                        # (n,)
        size = sq[:, None] + sq[None, :]                                 # (n, n)
        term = np.maximum(size - 2.0 * gram, 0.0)
        for i, j in zip(*np.nonzero(np.triu(term < 1e-6 * size, k=1))):  # cancellation: redo
            term[i, j] = term[j, i] = float(((self.scales[i] - self.scales[j]) ** 2) @ self.counts)
        np.fill_diagonal(term, 0.0)
        return term


def packed_model_sq_distances(models: Sequence[Sequence[Any]], *,
                              scale: Tensor | None = None) -> Tensor:
    """(n, n) float64 squared distances between whole BitDelta deltas, from bits and scales.

    `models[i]`: contributor i's BitDeltaPacked tensors (same order and layouts for everyone);
    the distance is over all of them together. `scale`: optional (n,) multipliers (clip factors).
    """
    return torch.from_numpy(PackedModel.build(models, scale=scale).sq_distances())


def packed_sq_norms(packed: Sequence[Any]) -> Tensor:
    """(n,) float64 squared L2 norms of BitDelta tensors: sum over groups of c * s^2."""
    _check_models([[p] for p in packed])
    counts = packed[0].group_counts().to(torch.float64)  # (n_groups,)
    rep = packed[0].rows // packed[0].scales.shape[0]  # 1, or rows for one scale row per tensor
    return torch.stack([(p.scales.to(torch.float64) ** 2 * counts).sum() * rep for p in packed])


def packed_pairwise_sq_distances(packed: Sequence[Any], *, scale: Tensor | None = None) -> Tensor:
    """(n, n) float64 squared distances between BitDelta-packed tensors, from bits and scales.

    `packed`: n BitDeltaPacked with identical layout (rows, cols, group_size).
    `scale`:  optional (n,) multipliers applied to contributor i's delta (e.g. clip factors),
              folded into the scales, so distances of clipped deltas need no decoding either.
    """
    if len(packed) == 0:
        raise InvalidDeltaError("`packed` is empty: need at least one BitDeltaPacked")
    return packed_model_sq_distances([[p] for p in packed], scale=scale)
