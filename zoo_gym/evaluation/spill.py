"""Tensors kept on disk instead of in memory: the server's base gradient between publish and scoring.

``SpilledTensors`` writes each tensor to an unlinked temporary file as it is produced and reads it back
with ``pread`` when asked for: nothing of it is resident, and the file disappears with the process.
Float32 tensors are stored rounded to bfloat16 (half the disk and the reads; the slopes it serves move by
at most 2^-9 sum_i |g_i delta_i|, typically ~1e-3 / sqrt(d) of |g| |delta|). ``read_ahead`` reads the next
tensor on a thread while one is used.
Writes go around the page cache (O_DIRECT, ``zoo_gym/io/direct_writes.py``) on a thread of their own (``put``
returns once its bytes are queued, up to ``queued_bytes`` waiting) and read pages leave the cache
(``zoo_gym/io/page_cache.py``). Why, and why not safetensors or memmap: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from zoo_gym.io.direct_writes import DirectWriter, QueuedWrites
from zoo_gym.io.read_ahead import ReadAhead
from zoo_gym.io.page_cache import drop_cached


class SpilledTensors(Mapping[str, Tensor]):
    """A read-only mapping name -> tensor whose values live in a temporary file.

    ``put(key, tensor)`` writes a tensor's bytes once; ``alias(name, key)`` makes ``name`` read it
    (tied weights: two names, one tensor); a name aliased to a key never written reads zeros of the
    recorded shape. Every read returns a fresh tensor (the caller owns it). After ``close()`` the
    file is gone and reads return meta tensors of the right shapes (holders still see the shapes).

    ``stored_dtype``: floating tensors of a wider dtype are written rounded to it (round to nearest
    even) and read back in their own dtype; ``stored(name)`` reads one as written. None: exact.
    ``queued_bytes``: how much of what ``put`` hands over may wait for the disk (written on a thread).
    """

    def __init__(self, directory: str | Path | None = None, *,
                 stored_dtype: torch.dtype | None = torch.bfloat16, queued_bytes: int = 16 << 20) -> None:
        self._file = tempfile.TemporaryFile(dir=directory, prefix="zoo-gym-spill-")  # unlinked at once
        self._writer = DirectWriter(self._file.fileno(), owns_fd=False)  # appends; no page cache
        # on a thread, up to `queued_bytes` waiting: the caller (a backward) goes on while the disk writes
        self._writes = QueuedWrites(self._writer, max_bytes=queued_bytes)
        self._end = 0
        self._stored_dtype = stored_dtype
        # key -> (offset, shape, dtype written, dtype put)
        self._where: dict[object, tuple[int, torch.Size, torch.dtype, torch.dtype]] = {}
        self._names: dict[str, tuple[object, torch.Size, torch.dtype]] = {}    # name -> (key, shape, dtype)
        self.closed = False

    def _narrowed(self, t: Tensor) -> Tensor:
        d = self._stored_dtype
        if d is None or not t.is_floating_point() or t.dtype.itemsize <= d.itemsize:
            return t
        return t.to(d)

    def put(self, key: object, tensor: Tensor) -> None:
        """Write ``tensor`` (CPU) under ``key``; each key once."""
        if key in self._where:
            raise ValueError(f"spilled key {key!r} written twice")
        given = tensor.detach()
        t = self._narrowed(given).contiguous()
        data = _bytes_of(t)
        self._writes.write(data)
        self._where[key] = (self._end, t.shape, t.dtype, given.dtype)
        self._end += len(data)

    def put_blocks(self, key: object, shape: torch.Size, blocks: Iterable[Tensor]) -> None:
        """Write a tensor of ``shape`` under ``key`` from ``blocks`` of its leading rows, in order (one block is
        resident at a time); they must fill ``shape`` exactly and share one dtype."""
        if key in self._where:
            raise ValueError(f"spilled key {key!r} written twice")
        start, rows, dtype = self._end, 0, None
        for block in blocks:
            t = block.detach()
            if dtype is not None and t.dtype != dtype or tuple(t.shape[1:]) != tuple(shape[1:]):
                raise ValueError(f"block of shape {tuple(t.shape)} {t.dtype} does not continue {tuple(shape)}")
            dtype = t.dtype
            data = _bytes_of(self._narrowed(t).contiguous())
            self._writes.write(data)
            self._end += len(data)
            rows += t.shape[0]
        if rows != shape[0] or dtype is None:
            raise ValueError(f"blocks of {rows} rows for a tensor of shape {tuple(shape)}")
        self._where[key] = (start, torch.Size(shape), self._narrowed(torch.empty(0, dtype=dtype)).dtype, dtype)

    def alias(self, name: str, key: object, shape: torch.Size, dtype: torch.dtype) -> None:
        self._names[name] = (key, torch.Size(shape), dtype)

    def distinct(self) -> list[str]:
        """One name per distinct tensor (the first alias of each key)."""
        first: dict[object, str] = {}
        for name, (key, _, _) in self._names.items():
            first.setdefault(key, name)
        return list(first.values())

    def shape(self, name: str) -> torch.Size:
        return self._names[name][1]

    def close(self) -> None:
        """Delete the file; reads return meta tensors from now on."""
        if not self.closed:
            try:
                self._writes.drain()  # the writer thread is done with the file before it closes
            except BaseException:  # noqa: BLE001 - closing after a failed write: it was raised before
                pass
            self._writer.close()
            self._file.close()
            self.closed = True

    def __getitem__(self, name: str) -> Tensor:
        key, shape, dtype = self._names[name]
        if self.closed:
            return torch.empty(shape, dtype=dtype, device="meta")
        where = self._where.get(key)
        if where is None:
            return torch.zeros(shape, dtype=dtype)
        return self.stored(name).to(where[3])  # in the dtype it was put in (a bf16 weight's gradient: float32)

    def stored(self, name: str) -> Tensor:
        """Tensor ``name`` as written (bfloat16 for a float32 put with the default ``stored_dtype``)."""
        key, shape, dtype = self._names[name]
        where = self._where.get(key) if not self.closed else None
        if where is None:
            return self[name]  # meta (closed) or zeros (never written)
        offset, _, written, _ = where
        self._writes.drain()
        self._writer.flush()  # the first read: what is still buffered reaches the file
        out = torch.empty(shape, dtype=written)
        view = _bytes_of(out)
        done = 0
        while done < len(view):
            n = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"spill file ended early reading {name!r}")
            done += n
        drop_cached(self._file.fileno(), offset, len(view))  # read once per round
        return out

    def stored_nbytes(self, name: str) -> int:
        """Bytes ``stored(name)`` reads (0: nothing written under its key)."""
        key, shape, _ = self._names[name]
        where = self._where.get(key)
        return 0 if where is None else where[2].itemsize * shape.numel()

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def read_ahead(spill: SpilledTensors, order: Sequence[str], *, max_bytes: int = 256 << 20) -> ReadAhead[Tensor]:
    """``get(name)``: ``spill.stored(name)``, the next name of ``order`` read on a thread meanwhile
    (zoo_gym/io/read_ahead.py); tensors over ``max_bytes`` (a vocabulary matrix) are read when asked for."""
    return ReadAhead(spill.stored, order, size=spill.stored_nbytes, max_bytes=max_bytes)


def _bytes_of(t: Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (any dtype, bfloat16 included)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
