"""Content-addressed blob store with durable, atomic writes.

Layout: ``<root>/sha256/<first two hex>/<hex>``; in-progress writes live in ``<root>/tmp`` (a `gym-server
ingest` process: its own ``<root>/ingest-tmp/<dir>``, flocked while it lives) and become visible only through
``os.replace`` after the data and the directory are fsynced, so a crash at any point leaves either no blob or
a whole one, never half of one; processes writing the same content write the same bytes to the same name.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
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


INGEST_TMP = "ingest-tmp"  # <root>/ingest-tmp/<pid>-<random>/: one ingest process's uploads in flight


@contextmanager
def _flocked(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """flock(LOCK_EX) on `path` (a file, created, or a directory) for the block; yields False when `wait` is
    False and another open file holds it."""
    fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class BlobStore:
    def __init__(self, root: Path, *, tmp_dir: Path | None = None) -> None:
        self.root = Path(root)
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else self.root / "tmp"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only, like the blobs (mkstemp: 0600)
        self.tmp_dir.mkdir(mode=0o700, exist_ok=True)
        (self.root / "sha256").mkdir(mode=0o700, exist_ok=True)
        self._tmp_lock: int | None = None  # own_tmp's store: the descriptor whose flock marks tmp_dir in use

    def own_tmp(self) -> "BlobStore":
        """The same blobs, with uploads staged in a new directory of this process's own under ingest-tmp/,
        flocked until the process ends (however it ends), so `serve`'s clean_tmp never removes them. The
        directories of processes that died are removed first (reclaim_ingest_tmp)."""
        parent = self.root / INGEST_TMP
        parent.mkdir(mode=0o700, exist_ok=True)
        with _flocked(parent / ".lock"):  # no reclaim between this mkdtemp and its flock
            reclaim_ingest_tmp(self.root, locked=True)
            path = Path(tempfile.mkdtemp(dir=parent, prefix=f"{os.getpid()}-"))
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        store = BlobStore(self.root, tmp_dir=path)
        store._tmp_lock = fd
        return store

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
        """Remove leftovers of writes a crash interrupted (never visible as blobs), and the staging directories
        of ingest processes that died (reclaim_ingest_tmp). Returns how many files and directories."""
        n = 0
        for p in self.tmp_dir.iterdir():
            p.unlink(missing_ok=True)
            n += 1
        return n + reclaim_ingest_tmp(self.root)


def reclaim_ingest_tmp(root: Path, *, locked: bool = False) -> int:
    """Remove the ingest-tmp/ directories no living process holds (their uploads were never acknowledged);
    returns how many. `locked`: the caller holds ingest-tmp/.lock already."""
    parent = Path(root) / INGEST_TMP
    if not parent.is_dir():
        return 0
    n = 0
    with nullcontext() if locked else _flocked(parent / ".lock"):
        for path in sorted(parent.iterdir()):
            if not path.is_dir():
                continue
            with _flocked(path, wait=False) as free:
                if free:
                    shutil.rmtree(path, ignore_errors=True)
                    n += 1
    return n
