"""The accepted, clipped rows of a `DeltaSource`, one tensor at a time, and the whole-model passes
over them: exact pairwise squared distances (from the BitDelta bits when the source has them,
consecutive packed tensors batched) and the distances to a combination sum_j a_j x_j (one pass per
iteration of the iterated rules). Memory grows with one tensor x n, never the model x n; a tensor whose n rows
exceed ROW_BLOCK_BYTES is read in blocks of its rows where the source can (`row_blocks`, issue 51).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import Tensor

from .distances import combination_sq_distances, packed_model_sq_distances, pairwise_sq_distances
from .scratch import Scratch

# sign bytes per contributor batched into one compressed-domain distance pass: bounds memory at
# about n x 16 MiB while removing per-tensor Python work on models with many small tensors
_PACKED_BATCH_BYTES = 16 << 20
# (n, numel) float32 rows of one tensor above this are read a block of the tensor's rows at a time (32 MB of them):
# smaller blocks decode each contributor's tensor bytes more often (a block reads them whole)
ROW_BLOCK_BYTES = 32 << 20


def row_blocks(source: Any, name: str, n: int) -> list[tuple[int, int]] | None:
    """[start, stop) element ranges of whole rows of tensor `name`, each about ROW_BLOCK_BYTES of (n, block)
    float32, when the source reads blocks (`stacked_block`; a wrapper says `reads_blocks`) and the whole (n,
    numel) rows would exceed that; None: read the tensor whole (`stacked`)."""
    if getattr(source, "stacked_block", None) is None or not getattr(source, "reads_blocks", True):
        return None
    shape = tuple(source.shape(name))
    numel = math.prod(shape)
    if len(shape) < 2 or n * numel * 4 <= ROW_BLOCK_BYTES:
        return None
    cols = numel // shape[0]
    per = max(1, ROW_BLOCK_BYTES // (n * cols * 4))
    return [(r * cols, min(r + per, shape[0]) * cols) for r in range(0, shape[0], per)]


K = TypeVar("K")


def read_ahead(parts: Iterable[tuple[K, Callable[[], Tensor]]]) -> Iterator[tuple[K, Tensor]]:
    """(key, rows) for each (key, () -> rows), the next part read in a helper thread while the caller works on
    this one: decoding a block (torch, mostly outside the GIL) overlaps the rule's compiled kernels instead of
    waiting for them (the measured gain: CHANGELOG). Two parts are in use at once: `ClippedRows.rows_block` lends
    two sets of buffers in turn."""
    it = iter(parts)
    first = next(it, None)
    if first is None:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="rows-ahead") as pool:
        key, pending = first[0], pool.submit(first[1])
        for nxt in it:
            rows = pending.result()
            pending = pool.submit(nxt[1])
            yield key, rows
            key = nxt[0]
        yield key, pending.result()


class ClippedRows:
    """Rows `acc` (k,) of the source's n contributions, each scaled by its clip factor (k,)."""

    def __init__(self, source: Any, names: Sequence[str], acc: Tensor, factors: Tensor, n: int) -> None:
        self.source, self.names, self.acc, self.factors, self.n = source, list(names), acc, factors, n
        self._lent = [(Scratch(), Scratch()) for _ in range(2)]  # a block as read, its accepted rows (rows_block)
        self._blocks = 0

    def rows(self, name: str) -> Tensor:
        """(k, numel) float32 clipped rows of tensor `name`. Without a refusal or a clip this is the
        source's own tensor (no copy; nothing downstream mutates it)."""
        x = self.source.stacked(name)  # (n, numel)
        if self.acc.numel() < self.n:
            x = x[self.acc]
        if bool((self.factors != 1).any()):
            x = x * self.factors.to(torch.float32)[:, None]
        return x

    def rows_block(self, name: str, start: int, stop: int) -> Tensor:
        """(k, stop - start) float32: elements [start, stop) of `rows(name)` (a block of `row_blocks`), in buffers
        lent again two blocks later (`read_ahead` holds two; blocks are read one at a time, in one thread)."""
        read, kept = self._lent[self._blocks % 2]
        self._blocks += 1
        into = read.get(self.n, stop - start)
        x = self.source.stacked_block(name, start, stop, out=into)  # (n, stop - start); a cached tensor's view
        mine = x is into
        if self.acc.numel() < self.n:
            x, mine = torch.index_select(x, 0, self.acc, out=kept.get(self.acc.numel(), stop - start)), True
        if bool((self.factors != 1).any()):
            f = self.factors.to(torch.float32)[:, None]
            x = x.mul_(f) if mine else x * f
        return x

    def parts(self, name: str) -> list[tuple[int, int, Any]]:
        """(start, stop, () -> (k, stop - start) rows) covering tensor `name`: one part unless it is read in blocks."""
        blocks = row_blocks(self.source, name, self.n)
        if blocks is None:
            return [(0, -1, lambda: self.rows(name))]
        return [(a, b, lambda a=a, b=b: self.rows_block(name, a, b)) for a, b in blocks]

    def pairwise_sq_distances(self) -> Tensor:
        """(k, k) float64 whole-model squared distances, summed over the tensors."""
        idx = self.acc.tolist()
        k = len(idx)
        dist = torch.zeros((k, k), dtype=torch.float64)
        batch: list[list[Any]] = [[] for _ in idx]  # batch[j]: accepted contributor j's tensors
        batch_bytes = 0
        for name in self.names:
            packed = self.source.packed(name)
            if packed is not None:  # BitDelta: batch tensors into one whole-model XOR pass
                for j, i in enumerate(idx):
                    batch[j].append(packed[i])
                batch_bytes += int(packed[idx[0]].signs.numel())
                if batch_bytes >= _PACKED_BATCH_BYTES:
                    dist += packed_model_sq_distances(batch, scale=self.factors)
                    batch, batch_bytes = [[] for _ in idx], 0
            else:
                dist += pairwise_sq_distances(self.rows(name))
        if batch_bytes:
            dist += packed_model_sq_distances(batch, scale=self.factors)
        return dist

    def cosines_to(self, reference: Any) -> Tensor:
        """One pass: (k,) float64 cosine of each clipped row with `reference` (a mapping name -> tensor; a name
        it lacks counts as zero), 0 for a zero row or a zero reference."""
        dots = torch.zeros(self.acc.numel(), dtype=torch.float64)
        sq_rows = torch.zeros_like(dots)
        sq_ref = 0.0
        for name in self.names:
            r = reference.get(name) if hasattr(reference, "get") else reference[name]
            if r is None:
                continue
            x = self.rows(name).to(torch.float64)
            r = r.reshape(-1).to(torch.float64)
            dots += x @ r
            sq_rows += (x * x).sum(1)
            sq_ref += float(r @ r)
        denom = sq_rows.sqrt() * sq_ref ** 0.5
        return torch.where(denom > 0, dots / torch.where(denom > 0, denom, torch.ones_like(denom)),
                           torch.zeros_like(dots))

    def sq_distances_to(self, coefficients: Tensor | None, previous: Tensor | None = None
                        ) -> tuple[Tensor, float]:
        """One pass: ((k,) squared distances of the rows to sum_j a_j x_j (None: the coordinate-wise
        median), squared distance of that iterate from `previous`'s), summed over the tensors."""
        sq = torch.zeros(self.acc.numel(), dtype=torch.float64)
        move = 0.0
        for name in self.names:
            s, m = combination_sq_distances(self.rows(name), coefficients, previous=previous)
            sq += s
            move += m
        return sq, move
