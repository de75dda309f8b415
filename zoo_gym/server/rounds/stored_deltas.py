"""`StoredDeltas`: the DeltaSource over a round's stored payloads, tensor by tensor, with a bounded cache of
decoded rows, LoRA norms from the factors, and row blocks for the Ray engine.

A payload is given as a buffer (bytes, a map) or as its blob's path; a path is read one tensor's bytes at a
time (`os.pread`) and nothing of it stays open or mapped between reads, and every payload's header is kept as
one shared layout per distinct set of entries (`Layouts`) plus two integers: what the server holds per
contributor is a few dozen bytes, not its parsed manifest (~30 KB) and a map (its pages in RSS) (issue 51).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch

from zoo_gym import codec
from zoo_gym.aggregation.packed_kernels import in_chunks
from zoo_gym.aggregation.scratch import Scratch
from zoo_gym.codec.bitdelta import unpack_bitdelta_into
from zoo_gym.codec.container import Manifest, TensorEntry


def _shifted(e: TensorEntry, by: int) -> TensorEntry:
    """`e` (and its LoRA factors) with every offset moved by `by` bytes."""
    return dataclasses.replace(e, offset=e.offset + by, factors=tuple(_shifted(f, by) for f in e.factors))


class Layouts:
    """Each payload's entries relative to its own body (the header's length varies with its metadata), interned:
    payloads encoded alike share one layout. Per payload: the layout's index, where its body starts, its size."""

    def __init__(self) -> None:
        self._index: dict[tuple, int] = {}
        self.layouts: list[dict[str, TensorEntry]] = []
        self.of: list[tuple[int, int, int, int]] = []  # (layout, body offset, payload size, format version)
        self._one: dict[tuple[int, str, int], Manifest] = {}  # one tensor's own manifest, per layout

    def add(self, manifest: Manifest) -> None:
        rel = tuple(_shifted(e, -manifest.body_offset) for e in manifest.entries)
        at = self._index.setdefault(rel, len(self.layouts))
        if at == len(self.layouts):
            self.layouts.append({e.name: e for e in rel})
        self.of.append((at, manifest.body_offset, manifest.payload_size, manifest.format_version))

    def entries(self, i: int) -> dict[str, TensorEntry]:
        return self.layouts[self.of[i][0]]

    def span(self, i: int, name: str) -> tuple[int, int, Manifest] | None:
        """(absolute start, bytes, a one-entry manifest for exactly those bytes) of payload i's tensor `name`."""
        layout, body, _, version = self.of[i]
        e = self.layouts[layout].get(name)
        if e is None:
            return None
        one = self._one.get((layout, name, version))
        if one is None:  # the same for every payload of this layout: made once
            one = self._one[layout, name, version] = Manifest(
                entries=[_shifted(e, -e.offset)], metadata={}, payload_size=e.nbytes, format_version=version,
                body_offset=0)
        return body + e.offset, e.nbytes, one


def _read(path: Path, start: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, start)
    finally:
        os.close(fd)
    if len(data) != size:
        raise codec.CodecError(f"{path} ended {size - len(data)} bytes early")
    return data


CACHE_BYTES = 128 << 20  # decoded rows kept between DeltaSoup's passes
_MIN_UNPACK_PER_CHUNK = 1 << 21  # BitDelta elements unpacked: below this a thread costs more than it saves


class StoredDeltas:
    """DeltaSource over a round's stored payloads (zoo_gym.aggregation.DeltaSource).

    DeltaSoup reads every tensor in more than one pass (validate, distances, aggregate). Decoded rows are
    kept in a cache bounded by `cache_bytes`, so small models are decoded once while a model larger
    than the budget still streams one tensor x n at a time. LoRA- and BitDelta-coded tensors are validated
    from their factors and scales (`sq_norms`), so a mean decodes each of them once. The budget is 128 MB (it
    was 512 MB: most of the peak from a few hundred contributors of the tiny base on, for passes that decode
    again in seconds).
    """

    def __init__(self, payloads: list, contributors: list[str], shapes: dict[str, tuple[int, ...]], *,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.contributors = contributors
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_left = cache_bytes
        self._vouched: dict[str, torch.Tensor] = {}  # sq_norms of tensors sent as safe float32 LoRA / BitDelta
        self._lora_only: set[str] = set()  # ... of those, the ones every contributor sent as LoRA factors
        self._packed_now: PackedTensor | None = None  # the tensor read in blocks, as sent (_packed_tensor)
        self._payloads = [p if not isinstance(p, (str, Path)) else Path(p) for p in payloads]
        self._shapes = shapes  # the base's tensors, in its file order
        self._layouts = Layouts()  # each header parsed once, kept as a shared layout + where its body starts
        for p in self._payloads:
            self._layouts.add(codec.read_manifest(p.read_bytes() if isinstance(p, Path) else p))
        names = set().union(*(set(e) for e in self._layouts.layouts))
        self._names = [n for n in shapes if n in names]  # base order: deterministic

    @property
    def n(self) -> int:
        return len(self._payloads)

    def _entry(self, i: int, name: str) -> TensorEntry | None:
        return self._layouts.entries(i).get(name)

    def _tensor(self, i: int, name: str) -> tuple[object, Manifest] | None:
        """(buffer, manifest) holding payload i's tensor `name` (read from its file when given a path)."""
        found = self._layouts.span(i, name)
        if found is None:
            return None
        start, size, one = found
        p = self._payloads[i]
        data = _read(p, start, size) if isinstance(p, Path) else memoryview(p)[start:start + size]
        return data, one

    def names(self) -> list[str]:
        return self._names

    def cached(self, name: str) -> bool:
        """Whether `stacked(name)` hands out rows this source keeps anyway (a SlopeTap then keeps them too)."""
        return name in self._cache

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name])

    def stacked(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        out = torch.empty((len(self._payloads), math.prod(self._shapes[name])))  # (n, numel), decoded in place
        for i, row in enumerate(out):
            self._decode_row(i, name, row)
        if out.nbytes <= self._cache_left:
            self._cache[name] = out
            self._cache_left -= out.nbytes
        return out

    def _decode_row(self, i: int, name: str, row: torch.Tensor) -> None:
        """Contributor i's tensor `name` decoded into `row` ((numel,) float32; zeros when it did not send it)."""
        shape = tuple(self._shapes[name])
        e = self._entry(i, name)
        if e is None:  # this contributor did not change the tensor (e.g. LoRA leaves norms alone)
            row.zero_()
            return
        payload, manifest = self._tensor(i, name)
        if e.codec == "lora" and e.dtype == "float32" and tuple(e.shape) == shape:
            codec.decode_factors(payload, name, manifest=manifest).merged(out=row.view(shape))  # one matmul
        else:
            row.copy_(codec.decode_tensor(payload, name, manifest=manifest).reshape(-1))

    def stacked_block(self, name: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, stop - start) float32: elements [start, stop) of `stacked(name)`'s rows, the same numbers, into `out`
        when given (a cached tensor's rows are returned as a view instead). A block of whole rows of the tensor's
        2-D view is decoded from those rows alone (BitDelta signs and scales, LoRA B's rows times A, the dense
        codecs' bytes: codec.decode_rows); other blocks (and int4 rows off a byte) decode each contributor's tensor
        whole into one scratch row. Memory: the block x n (plus that one tensor where it is decoded whole)."""
        if name in self._cache:
            return self._cache[name][:, start:stop]
        shape = tuple(self._shapes[name])
        cols = math.prod(shape[1:]) if len(shape) > 1 else 0
        out = torch.empty((len(self._payloads), stop - start)) if out is None else out
        if cols and start % cols == 0 and stop % cols == 0:
            self._packed_tensor(name).rows(start // cols, stop // cols, out)
            return out
        scratch = torch.empty(math.prod(shape))
        for i in range(len(self._payloads)):
            self._decode_row(i, name, scratch)
            out[i].copy_(scratch[start:stop])
        return out

    def _packed_tensor(self, name: str) -> "PackedTensor":
        """Every contributor's tensor `name` as sent, stacked, kept for the one tensor being read in blocks: a block
        then unpacks its rows for all contributors at once from memory (a few KB a contributor) instead of reading
        and parsing every payload again (~100 us a contributor and block)."""
        if self._packed_now is None or self._packed_now.name != name:
            self._packed_now = None  # the previous tensor's go first
            self._packed_now = PackedTensor(self, name)
        return self._packed_now

    def _decode_rows(self, i: int, name: str, r0: int, r1: int, out: torch.Tensor) -> None:
        """Rows [r0, r1) of contributor i's tensor `name` in its 2-D view, into `out` ((r1 - r0, cols) float32)."""
        e = self._entry(i, name)
        if e is None:
            out.zero_()
            return
        shape = tuple(self._shapes[name])
        if e.codec == "lora" and tuple(e.shape) == shape and len(shape) == 2:
            f = self._factors(i, name)
            torch.matmul(f.B[r0:r1].float(), f.A.float(), out=out)
        elif e.codec == "bitdelta" and tuple(e.shape) == shape:
            out.copy_(self._bits(i, name).rows_dense(r0, r1))
        else:
            if tuple(e.shape) == shape and len(shape) >= 2:  # a dense codec decodes those rows' bytes alone
                payload, manifest = self._tensor(i, name)
                rows = codec.decode_rows(payload, name, r0, r1, manifest=manifest)
                if rows is not None:
                    out.copy_(rows)
                    return
            scratch = torch.empty(math.prod(shape))
            self._decode_row(i, name, scratch)
            out.copy_(scratch.view(shape[0], -1)[r0:r1])

    def sq_norms(self, name: str) -> tuple[torch.Tensor, int] | None:
        """((n,) float64 squared L2 norms of the rows `stacked(name)` returns, numel) from what was sent, nothing
        decoded: LoRA factors' r x r Gram matrices (`LoraFactors.merged_sq_norm`) and BitDelta scales
        (`BitDeltaPacked.sq_norm`), so DeltaSoup's validation reads no rows. None unless every contributor that
        sent the tensor sent float32 LoRA factors or float32 BitDelta the norm is safe from (then DeltaSoup
        decodes). A cached tensor is not decoded again either way; norms already taken are returned again."""
        if name in self._vouched:
            return self._vouched[name], math.prod(self._shapes[name])
        if name in self._cache:
            return None
        shape = tuple(self._shapes[name])
        out = torch.zeros(len(self._payloads), dtype=torch.float64)  # (n,)
        lora_only = True
        for i in range(self.n):
            e = self._entry(i, name)
            if e is None:
                continue  # did not change the tensor: a zero row
            if e.codec not in ("lora", "bitdelta") or (e.codec == "bitdelta" and tuple(e.shape) != shape):
                return None
            payload, manifest = self._tensor(i, name)
            sq = codec.sent_sq_norm(payload, name, manifest=manifest)  # None: not float32, or not safe
            if sq is None:
                return None
            out[i], lora_only = sq, lora_only and e.codec == "lora"
        self._vouched[name] = out
        if lora_only:
            self._lora_only.add(name)
        return out, math.prod(shape)

    def factors(self, name: str) -> list | None:
        """Each contributor's LoraFactors of `name` (None: it did not send the tensor), for a tensor whose
        norms `sq_norms` vouched for from LoRA factors alone (finite, no overflow, no cancellation); else None
        (rows are decoded)."""
        if name not in self._lora_only:
            return None
        shape = tuple(self._shapes[name])
        out = []
        for i in range(self.n):
            e = self._entry(i, name)
            if e is not None and tuple(e.shape) != shape:
                return None
            out.append(None if e is None else self._factors(i, name))
        return out

    def _factors(self, i: int, name: str):
        payload, manifest = self._tensor(i, name)
        return codec.decode_factors(payload, name, manifest=manifest)

    def stacked_one(self, i: int, name: str) -> torch.Tensor:
        """Contributor i's delta for one tensor, in the base's shape (zeros when it did not send it)."""
        found = self._tensor(i, name)
        if found is not None:
            payload, manifest = found
            return codec.decode_tensor(payload, name, manifest=manifest).reshape(self._shapes[name]).float()
        return torch.zeros(self._shapes[name])

    def packed(self, name: str):
        if not all(name in e and e[name].codec == "bitdelta"
                   for e in (self._layouts.entries(i) for i in range(self.n))):
            return None
        return [self._bits(i, name) for i in range(self.n)]

    def _bits(self, i: int, name: str):
        payload, manifest = self._tensor(i, name)
        return codec.read_bitdelta(payload, name, manifest=manifest)


class PackedTensor:
    """One tensor of every contributor as sent, for reading whole rows of it in blocks: the BitDelta signs and
    scales stacked per layout, the LoRA factors stacked per rank, anything else decoded per row block."""

    def __init__(self, stored: StoredDeltas, name: str) -> None:
        self.name, self._stored = name, stored
        shape = tuple(stored._shapes[name])
        plan: dict[tuple, list[int]] = {}  # (kind, what fixes its layout) -> contributors, from the headers alone
        self.absent, self.other = [], []
        for i in range(stored.n):
            e = stored._entry(i, name)
            if e is None:
                self.absent.append(i)
            elif e.codec == "lora" and tuple(e.shape) == shape and len(shape) == 2:
                plan.setdefault(("lora", e.rank), []).append(i)
            elif e.codec == "bitdelta" and tuple(e.shape) == shape:
                plan.setdefault(("bits", e.group_size, e.scale_dtype), []).append(i)
            else:
                self.other.append(i)
        self.bits, self.lora = [], []
        self._product = Scratch()  # LoRA products of a block for some of the contributors (rows)
        for key, members in plan.items():
            if key[0] == "lora":
                idx, (b, a), _ = self._stacked(members, lambda i: stored._factors(i, name),
                                               lambda f: (f.B.float(), f.A.float()))
                self.lora.append((idx, b, a))
            else:
                idx, (signs, scales), first = self._stacked(members, lambda i: stored._bits(i, name),
                                                            lambda b: (b.signs, b.scales))
                self.bits.append((idx, signs, scales, first))

    def _stacked(self, members: list[int], read, parts) -> tuple[torch.Tensor, list[torch.Tensor], object]:
        """(contributors, their `parts` stacked, the first one read): each read straight into storage made for all
        of them (a list of the pieces and then a stack would hold both, twice the tensor as sent); one whose pieces
        are laid out otherwise is decoded per block instead (`other`)."""
        store, first, kept = None, None, []
        for i in members:
            x = read(i)
            got = parts(x)
            if store is None:
                store, first = [torch.empty((len(members), *p.shape), dtype=p.dtype) for p in got], x
            if any(tuple(p.shape) != tuple(s.shape[1:]) or p.dtype != s.dtype for p, s in zip(got, store)):
                self.other.append(i)
                continue
            for p, s in zip(got, store):
                s[len(kept)] = p
            kept.append(i)
        return torch.tensor(kept), [s[:len(kept)] for s in store], first

    def rows(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """Rows [r0, r1) of every contributor's tensor (2-D view) into `out` ((n, (r1 - r0) x cols) float32)."""
        if self.absent:
            out[self.absent] = 0.0
        for idx, signs, scales, first in self.bits:  # straight into the contributors' rows, on every core
            in_chunks(lambda j0, j1: unpack_bitdelta_into(
                signs, scales, idx, r0=r0, r1=r1, cols=first.cols, group_size=first.group_size, out=out, j0=j0,
                j1=j1), idx.numel(), min_chunk=_MIN_UNPACK_PER_CHUNK // max((r1 - r0) * first.cols, 1))
        for idx, b, a in self.lora:
            if idx.numel() == out.shape[0]:  # every contributor, in order: the product straight into `out`
                torch.bmm(b[:, r0:r1], a, out=out.view(idx.numel(), r1 - r0, -1))
            else:  # some: through a buffer kept from block to block
                product = self._product.get(idx.numel(), r1 - r0, a.shape[2])
                out[idx] = torch.bmm(b[:, r0:r1], a, out=product).view(idx.numel(), -1)
        if self.other:
            cols = out.shape[1] // (r1 - r0)
            for i in self.other:
                self._stored._decode_rows(i, self.name, r0, r1, out[i].view(-1, cols))
