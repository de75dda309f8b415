"""Content-addressed blob store with durable, atomic writes.

Layout: ``<root>/sha256/<first two hex>/<hex>``; in-progress writes live in ``<root>/tmp`` and become
visible only through ``os.replace`` after the data and the directory are fsynced, so a crash at any point
leaves either no blob or a whole one, never half of one.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from zoo_gym.io.direct_writes import DirectWriter
from zoo_gym.io.page_cache import StreamedRanges


@contextmanager
def map_file(path: Path) -> Iterator[mmap.mmap]:
    """A read-only memory map of a file. Tensors decoded from it may still view it when the block ends
    (e.g. inside an exception's traceback); then the map is left to the garbage collector to close."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise BlobError(f"{path} is empty")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield m
    finally:
        try:
            m.close()
        except BufferError:
            pass


class BlobError(ValueError):
    """A blob does not match what was declared (size or sha256)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobWriter:
    """A temporary file that hashes what is written and is committed or discarded as a whole.

    `streamed=True` is for blobs of gigabytes that nobody reads back soon (a published checkpoint's master low
    halves, read by the next publish; a checkpoint when the server does not evaluate it): they bypass the page
    cache (O_DIRECT, zoo_gym/io/direct_writes.py), or where the file system refuses that, their pages leave it as
    the writes go (zoo_gym/io/page_cache.py says why). A checkpoint its held-out evaluation reads back at once
    stays in the page cache (docs/design/checkpoint-publishing.md)."""

    def __init__(self, store: "BlobStore", *, streamed: bool = False) -> None:
        self._store = store
        fd, name = tempfile.mkstemp(dir=store.tmp_dir, prefix="blob-")
        self.path = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0
        self._file: BinaryIO | DirectWriter = DirectWriter(fd) if streamed else os.fdopen(fd, "wb")
        self._ranges = None if streamed else StreamedRanges(keep_cached=True)  # to writeback as they come

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)
        if self._ranges is not None and self._ranges.due(self.size):
            self._file.flush()
            self._ranges.written(self._file.fileno(), self.size)

    def flush(self) -> None:
        """Make what was written readable through `self.path` (not yet durable, not yet visible)."""
        self._file.flush()

    def _fsync(self) -> None:
        if isinstance(self._file, DirectWriter):
            self._file.finish()
        else:
            self._file.flush()
            os.fsync(self._file.fileno())

    def sync(self) -> None:
        """flush + fsync the data now (e.g. in a thread while the caller validates the same bytes)."""
        self._fsync()
        self._synced_size = self.size

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def commit(self, *, expect_sha256: str | None = None) -> str:
        """fsync, move into place, fsync the directory; return the sha256. Idempotent for equal content."""
        if getattr(self, "_synced_size", None) != self.size:
            self._fsync()
        self._file.close()
        digest = self.sha256
        if expect_sha256 is not None and digest != expect_sha256:
            self.discard()
            raise BlobError(f"content sha256 is {digest}, but {expect_sha256} was declared")
        final = self._store.path(digest)
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(self.path, final)
        _fsync_dir(final.parent)
        return digest

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tmp_dir = self.root / "tmp"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only, like the blobs (mkstemp: 0600)
        self.tmp_dir.mkdir(mode=0o700, exist_ok=True)
        (self.root / "sha256").mkdir(mode=0o700, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise BlobError(f"not a sha256 hex digest: {sha256[:80]!r}")
        return self.root / "sha256" / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        return self.path(sha256).stat().st_size

    @contextmanager
    def writer(self, *, streamed: bool = False) -> Iterator[BlobWriter]:
        """Yield a BlobWriter (`streamed`: see BlobWriter); anything not committed inside the block is discarded."""
        w = BlobWriter(self, streamed=streamed)
        try:
            yield w
        finally:
            if w.path.exists():
                w.discard()

    @contextmanager
    def mapped(self, sha256: str) -> Iterator[mmap.mmap]:
        """The blob as a read-only memory map (decoding never copies the whole payload)."""
        with map_file(self.path(sha256)) as m:
            yield m

    def remove(self, sha256: str) -> None:
        """Delete a blob (callers make sure no row references it) and make the deletion durable."""
        path = self.path(sha256)
        path.unlink(missing_ok=True)
        if path.parent.is_dir():
            _fsync_dir(path.parent)

    def clean_tmp(self) -> int:
        """Remove leftovers of writes a crash interrupted (never visible as blobs). Returns how many."""
        n = 0
        for p in self.tmp_dir.iterdir():
            p.unlink(missing_ok=True)
            n += 1
        return n
