"""Several BitDelta tensors of n contributors laid end to end, group by group, in one array.

BitDelta (Liu et al. 2024, arXiv:2402.10193) codes a tensor as one scale per (row, group) times
packed sign bits. Groups start on byte boundaries, so the sign bytes of every tensor of one
contributor can be laid end to end into ONE word vector, each group zero-padded to whole words
(a zero pad XORs to 0 and is dropped when results are split back into tensors). Distances
(`distances.py`) and the weighted mean (`packed_mean.py`) then run over that one vector in
cache-sized chunks, instead of paying Python and numpy call overheads per tensor and per pair.

Built once per aggregation from the decoded-free `BitDeltaPacked` views; per tensor the copies
are done for all contributors at once (one stacked copy), so the cost is a memcpy of the signs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .errors import InvalidDeltaError

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
    for t in range(n_t):
        p0 = models[0][t]
        _check_one(p0, where=f"models[0][{t}]")
        ref = _layout(p0)  # everyone else must match it exactly, so one full check suffices
        for i, m in enumerate(models):
            p = m[t]
            if _layout(p) != ref:
                _check_one(p, where=f"models[{i}][{t}]")
                raise InvalidDeltaError(
                    f"contributor {i} tensor {t} has layout rows={p.rows} cols={p.cols} "
                    f"group_size={p.group_size} scales={tuple(p.scales.shape)}, but contributor 0 "
                    f"has {ref[:4]}; compressed-domain distances need identical layouts (decode "
                    "and use pairwise_sq_distances instead)")
    return n_t


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
    unpadded: bool  # no padding anywhere: a contributor's row is its sign bytes end to end


@functools.lru_cache(maxsize=32)
def _plan(layouts: tuple[tuple, ...]) -> _Plan:
    """`layouts`: per tensor (rows, cols, group_size, scales shape, signs shape, dtype, shape).
    A server aggregates the same model shape round after round, so this is cached."""
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
        slots.append(TensorSlot(shape=lay[6], rows=r, cols=cols, group_size=group_size,
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
    counts.flags.writeable = starts.flags.writeable = False  # shared by every build of this shape
    return _Plan(word=word, total=total, n_groups=n_groups, counts=counts, starts=starts,
                 group_words=widest // word if uniform else 0, slots=tuple(slots),
                 unpadded=total == raw)


def _copy_signs(buf: np.ndarray, s: TensorSlot, signs: list[np.ndarray]) -> None:
    """Copy every contributor's (rows, bytes) sign array of one tensor into its padded slot."""
    n = buf.shape[0]
    gb, full = s.full_bytes, s.full_groups
    pf, row_bytes = s.padded_full, s.row_bytes
    last = -(-s.cols // 8) - gb * full
    region = buf[:, s.first_byte:s.first_byte + s.rows * row_bytes].reshape(n, s.rows, row_bytes)
    if full == 0 or pf == gb:  # a row is [its sign bytes][tail padding]: one stacked copy
        np.stack(signs, out=region[:, :, :gb * full + last])
    else:  # padding after every full group
        for i, sg in enumerate(signs):
            region[i, :, :pf * full].reshape(s.rows, full, pf)[..., :gb] = \
                sg[:, :gb * full].reshape(s.rows, full, gb)
            region[i, :, pf * full:pf * full + last] = sg[:, gb * full:]


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
        check_models(models)
        n = len(models)
        mult = np.ones(n) if scale is None else torch.as_tensor(scale, dtype=torch.float64).numpy()
        if mult.shape != (n,):
            raise InvalidDeltaError(f"`scale` must have one entry per contributor ({n}), got "
                                    f"{tuple(mult.shape)}")
        plan = _plan(tuple(_layout(p) + (tuple(p.shape),) for p in models[0]))
        buf = np.zeros((n, plan.total), dtype=np.uint8)           # (n, padded bytes)
        scales = np.empty((n, plan.n_groups), dtype=np.float64)  # (n, G)
        for i, m in enumerate(models):  # one contributor's scales, end to end, times its multiplier
            row = torch.cat([p.scales.reshape(-1) if p.scales.shape[0] == p.rows
                             else p.scales.expand(p.rows, -1).reshape(-1) for p in m])
            np.multiply(row.numpy(), mult[i], out=scales[i])
        if plan.unpadded:  # a contributor's sign bytes end to end ARE its row: one copy each
            for i, m in enumerate(models):
                torch.cat([p.signs.reshape(-1) for p in m], out=torch.from_numpy(buf[i]))
        else:
            for t, s in enumerate(plan.slots):
                _copy_signs(buf, s, [m[t].signs.numpy() for m in models])
        return cls(words=buf.view(_WORD[plan.word]), scales=scales, counts=plan.counts,
                   starts=plan.starts, group_words=plan.group_words, slots=plan.slots)

    def split(self, flat: Tensor) -> list[Tensor]:
        """Per-tensor views of a per-element result laid out like the sign bits.

        `flat`: (n_words * word_bytes * 8,) one value per sign bit, padding included. Returns one
        tensor per slot, shaped like the original; a view where the layout allows (no padding
        inside rows), else a copy without the padding.
        """
        out = []
        for s in self.slots:
            row_el = s.row_bytes * 8
            region = flat[s.first_byte * 8:s.first_byte * 8 + s.rows * row_el].view(s.rows, row_el)
            if s.full_groups == 0 or s.padded_full == s.full_bytes:
                t = region[:, :s.cols]  # (rows, cols): groups are contiguous within a row
            else:  # padding between full groups: drop it (copy)
                full = region[:, :s.padded_full * 8 * s.full_groups].reshape(
                    s.rows, s.full_groups, s.padded_full * 8)[:, :, :s.group_size]
                tail = s.cols - s.group_size * s.full_groups
                start = s.padded_full * 8 * s.full_groups
                t = torch.cat([full.reshape(s.rows, -1), region[:, start:start + tail]], dim=1)
            out.append(t if t.shape == s.shape else t.reshape(s.shape))
        return out
