"""Several BitDelta tensors of n contributors laid end to end, group by group, in one array.

BitDelta (Liu et al. 2024, arXiv:2402.10193) codes a tensor as one scale per (row, group) times packed
sign bits. A `PackedModel` holds every contributor's sign bytes as ONE word vector, each group
zero-padded to whole words (a zero pad XORs to 0 and is dropped when results are split back into
tensors), plus the scales. Built once per aggregation from the `BitDeltaPacked` views by one compiled
call (`packed_kernels.gather`), checking that every contributor has the same layout; `distances.py` and
`packed_mean.py` run over it. Design: docs/design/aggregation.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .errors import InvalidDeltaError
from .packed_kernels import TENSOR_FIELDS, gather

_MAX_PAD = 1.25  # accept zero padding up to 25 % more sign bytes for a simpler word layout
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ---- layout checks -----------------------------------------------------------------------------
def _layout(p: Any) -> tuple:
    return (p.rows, p.cols, p.group_size, tuple(p.scales.shape), tuple(p.signs.shape), p.signs.dtype)


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


def _check_same(ref: Sequence[Any], m: Sequence[Any], i: int) -> None:
    """Contributor i's tensors must have contributor 0's (checked) layouts exactly."""
    for t, (p0, p) in enumerate(zip(ref, m)):
        if _layout(p) != _layout(p0):
            _check_one(p, where=f"models[{i}][{t}]")
            raise InvalidDeltaError(
                f"contributor {i} tensor {t} has layout rows={p.rows} cols={p.cols} "
                f"group_size={p.group_size} scales={tuple(p.scales.shape)}, but contributor 0 "
                f"has {_layout(p0)[:4]}; compressed-domain distances need identical layouts (decode "
                "and use pairwise_sq_distances instead)")


def check_models(models: Sequence[Sequence[Any]]) -> int:
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
    for t, p0 in enumerate(models[0]):
        _check_one(p0, where=f"models[0][{t}]")
    for i, m in enumerate(models[1:], start=1):
        _check_same(models[0], m, i)
    return n_t


def _layout_of(p: Any) -> tuple:
    """(shape, rows, cols, group_size, scale rows, n_groups): `BitDeltaPacked.checked_layout`."""
    return (tuple(p.shape), p.rows, p.cols, p.group_size, p.scales.shape[0], p.scales.shape[1])


def _readable(m: Sequence[Any]) -> list[Any]:
    """Contributor m's tensors as `gather` reads them (CPU, C-contiguous, float32 or float64
    scales), copied only where needed."""
    out = []
    for p in m:
        signs, sc = p.signs.cpu().contiguous(), p.scales.cpu()
        sc = (sc if sc.dtype in (torch.float32, torch.float64) else sc.to(torch.float64)).contiguous()
        out.append(p if signs is p.signs and sc is p.scales else dataclasses.replace(p, signs=signs, scales=sc))
    return out


def _prepare(models: Sequence[Sequence[Any]]) -> tuple[list[Sequence[Any]], tuple[tuple, ...], np.ndarray]:
    """Check the layouts (as `check_models`); return every contributor's tensors in a form
    `gather` can read, the per-tensor layouts, and (n, T) flags for float64 scales.

    A `BitDeltaPacked` checks its own tensors when it is made (`checked_layout`); a contributor
    whose checked layouts equal contributor 0's is checked by that one list comparison. Anyone
    else is checked tensor by tensor, with an error naming the first mismatch, and copied where
    `gather` could not read a tensor as it is.
    """
    if len(models) == 0 or len(models[0]) == 0 or any(len(m) != len(models[0]) for m in models):
        check_models(models)  # raises, naming what is missing
    ref: list | None = [getattr(p, "checked_layout", None) for p in models[0]]
    if None in ref:
        for t, p in enumerate(models[0]):
            _check_one(p, where=f"models[0][{t}]")
        ref = None
    n_t = len(models[0])
    out, f64 = [], np.zeros((len(models), n_t), dtype=np.bool_)
    for i, m in enumerate(models):
        if ref is not None and [getattr(p, "checked_layout", None) for p in m] == ref:
            out.append(m)  # float32 scales: flags stay False
            continue
        if i > 0:
            _check_same(models[0], m, i)
        m = _readable(m)
        out.append(m)
        f64[i] = [p.scales.dtype == torch.float64 for p in m]
    layouts = tuple(ref) if ref is not None else tuple(_layout_of(p) for p in models[0])
    return out, layouts, f64


# ---- layout -------------------------------------------------------------------------------------
def _group_bytes_of(*, rows: int, cols: int, group_size: int, n_groups: int) -> tuple[int, int, int, int]:
    """(n_groups, bytes of a full group, full groups per row, bytes of the last group)."""
    nbytes = -(-cols // 8)
    gb = nbytes if n_groups == 1 else group_size // 8
    last = nbytes - gb * (n_groups - 1)
    return n_groups, gb, n_groups - 1, last


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the packed vector (bytes; rows are laid out back to back)."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    group_size: int
    first_group: int  # index of the tensor's first group
    groups_per_row: int
    first_byte: int  # offset of the tensor's first row
    full_groups: int  # full groups per row (all groups but the last)
    full_bytes: int  # real sign bytes of a full group
    padded_full: int  # bytes a full group occupies (>= full_bytes)
    padded_last: int  # bytes the last group occupies

    @property
    def row_bytes(self) -> int:
        return self.padded_full * self.full_groups + self.padded_last


@dataclass(frozen=True)
class _Plan:
    """Where everything goes for one list of tensor layouts (computed once per model shape)."""

    word: int  # bytes per word
    total: int  # padded bytes per contributor
    n_groups: int
    counts: np.ndarray  # (G,) float64, read-only
    starts: np.ndarray  # (G,) int64 first word of each group, read-only
    group_words: int
    slots: tuple[TensorSlot, ...]
    table: np.ndarray  # (T, len(TENSOR_FIELDS)) int64: `packed_kernels.gather`'s per-tensor table


@functools.lru_cache(maxsize=32)
def _plan(checked: tuple[tuple, ...]) -> _Plan:
    """`checked`: per tensor its checked layout (shape, rows, cols, group_size, scale rows,
    n_groups). A server aggregates the same model shape round after round, so this is cached."""
    layouts = [(k[1], k[2], k[3], (k[4], k[5]), k[0]) for k in checked]  # rows, cols, group, scales, shape
    shapes = [_group_bytes_of(rows=lay[0], cols=lay[1], group_size=lay[2], n_groups=lay[3][1])
              for lay in layouts]
    rows = [lay[0] for lay in layouts]
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
    counts = np.empty(n_groups, dtype=np.float64)  # (G,)
    starts = np.empty(n_groups, dtype=np.int64)    # (G,) in bytes, then words
    slots = []
    pos = gpos = 0
    for lay, (g, gb, full, last), (pf, pl), r in zip(layouts, shapes, pads, rows):
        cols, group_size = lay[1], lay[2]
        row_bytes = pf * full + pl
        slots.append(TensorSlot(shape=tuple(lay[4]), rows=r, cols=cols, group_size=group_size,
                                first_group=gpos, groups_per_row=g, first_byte=pos, full_groups=full,
                                full_bytes=gb, padded_full=pf, padded_last=pl))
        offs = np.concatenate([np.arange(full) * pf, [pf * full]])  # (g,) group offsets in a row
        starts[gpos:gpos + r * g] = (pos + np.arange(r)[:, None] * row_bytes + offs).ravel()
        per_row = np.full(g, group_size, dtype=np.float64)
        per_row[-1] = cols - group_size * (g - 1)
        counts[gpos:gpos + r * g] = np.tile(per_row, r)
        pos += r * row_bytes
        gpos += r * g
    starts //= word
    table = np.array([[s.rows, -(-s.cols // 8), s.first_byte, s.full_groups, s.full_bytes, s.padded_full,
                       s.padded_last, s.groups_per_row, lay[3][0], s.first_group]
                      for s, lay in zip(slots, layouts)], dtype=np.int64).reshape(-1, len(TENSOR_FIELDS))
    for a in (counts, starts, table):
        a.flags.writeable = False  # shared by every build of this shape
    return _Plan(word=word, total=total, n_groups=n_groups, counts=counts, starts=starts,
                 group_words=widest // word if uniform else 0, slots=tuple(slots), table=table)


@dataclass(frozen=True)
class PackedModel:
    """Several BitDelta tensors of n contributors laid end to end, group by group.

    words:       (n, n_words) uint8/16/32/64 sign bits; each group zero-padded to whole words
    scales:      (n, n_groups) float64 per-group scales (times any per-contributor multiplier)
    counts:      (n_groups,) float64 real elements per group
    starts:      (n_groups,) int64 first word of each group
    group_words: words in every group when all groups have the same padded length, else 0
    slots:       where each tensor lives, to split a per-element result back into tensors
    """

    words: np.ndarray
    scales: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    group_words: int
    slots: tuple[TensorSlot, ...] = ()

    @property
    def word_bytes(self) -> int:
        return self.words.dtype.itemsize

    @classmethod
    def build(cls, models: Sequence[Sequence[Any]], *, scale: Tensor | None = None) -> PackedModel:
        """`models[i]`: contributor i's BitDeltaPacked tensors (same order and layouts for all);
        `scale`: optional (n,) multipliers folded into contributor i's scales (e.g. clip factors)."""
        tensors, layouts, scale_f64 = _prepare(models)
        n = len(models)
        mult = np.ones(n) if scale is None else torch.as_tensor(scale, dtype=torch.float64).numpy()
        if mult.shape != (n,):
            raise InvalidDeltaError(f"`scale` must have one entry per contributor ({n}), got "
                                    f"{tuple(mult.shape)}")
        plan = _plan(layouts)
        addrs = np.array([[(p.signs.data_ptr(), p.scales.data_ptr()) for p in m] for m in tensors],
                         dtype=np.int64).reshape(n, -1, 2)  # (n, T, 2)
        buf = np.empty((n, plan.total), dtype=np.uint8)           # (n, padded bytes)
        scales = np.empty((n, plan.n_groups), dtype=np.float64)  # (n, G)
        # `_prepare` checked every shape, dtype, device and contiguity the addresses rely on
        gather(addrs, scale_f64,
               np.ascontiguousarray(mult, dtype=np.float64), plan.table, buf, scales)
        return cls(words=buf.view(_WORD[plan.word]), scales=scales, counts=plan.counts,
                   starts=plan.starts, group_words=plan.group_words, slots=plan.slots)

    def split(self, flat: Tensor) -> list[Tensor]:
        """Per-tensor views of a per-element result laid out like the sign bits.

        `flat`: (n_words * word_bytes * 8,) one value per sign bit, padding included. Returns one
        tensor per slot, shaped like the original; a view where the layout allows (no padding
        inside rows), else a copy without the padding.
        """
        f = flat.numpy()  # numpy views: a tenth of torch's per-call cost, and no copy
        out = []
        for s in self.slots:
            row_el = s.row_bytes * 8
            region = f[s.first_byte * 8:s.first_byte * 8 + s.rows * row_el].reshape(s.rows, row_el)
            if s.full_groups == 0 or s.padded_full == s.full_bytes:
                t = region[:, :s.cols]  # (rows, cols): groups are contiguous within a row
            else:  # padding between full groups: drop it (copy)
                full = region[:, :s.padded_full * 8 * s.full_groups].reshape(
                    s.rows, s.full_groups, s.padded_full * 8)[:, :, :s.group_size]
                tail = s.cols - s.group_size * s.full_groups
                start = s.padded_full * 8 * s.full_groups
                t = np.concatenate([full.reshape(s.rows, -1), region[:, start:start + tail]], axis=1)
            out.append(torch.from_numpy(t.reshape(s.shape)))
        return out
