"""Streaming gigabytes through files without growing the page cache by their size.

`drop_cached` asks the kernel to drop a range's clean pages (and start writing back its dirty ones), for
files read once. `StreamedRanges` does it for a file written front to back: every `step` bytes it hands
the new pages to writeback and drops the previous step's (clean by then), so at most two steps stay
cached. Writes bypass the cache altogether where the file system allows (zoo_gym/io/direct_writes.py); this
module serves the reads, and the writes where O_DIRECT is refused. With `keep_cached` a file read back soon
(a published checkpoint) has its pages handed to writeback as they come and kept cached. All of it is
a hint: nothing happens without posix_fadvise (sync_file_range). Why: docs/design/checkpoint-publishing.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

DROP_STEP = 64 << 20  # bytes between releases


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop a file range's clean pages from the page cache and to start writing back
    its dirty ones (which the next call for the range then drops); length 0: to the end of the file. A
    hint: nothing happens where the platform has no posix_fadvise."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range's dirty pages to the device now and keep them cached (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which Python's os module lacks): a later fsync finds them
    written instead of writing the whole file at once. A hint: nothing happens elsewhere."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE = 2


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


def drop_file_cache(path) -> None:
    """`drop_cached` for a whole file by its path: the next read comes from the device (benchmarks' cold reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cached(fd)
    finally:
        os.close(fd)


class StreamedRanges:
    """Call `written(fd, end)` after writing a file up to byte `end` (front to back). Every `step` bytes the new
    pages go to writeback; the previous step's (clean by then) are dropped, or with `keep_cached` stay cached
    (a file read back soon: the final fsync then finds them written)."""

    def __init__(self, step: int | None = None, *, keep_cached: bool = False) -> None:
        self.step = DROP_STEP if step is None else step
        self.keep_cached = keep_cached
        self._marks = (0, 0)  # (start of the range handed to writeback a step ago, end of it)

    def due(self, end: int) -> bool:
        """Whether a file written up to `end` has a step's worth of pages not yet handed to writeback."""
        return end - self._marks[1] >= self.step

    def written(self, fd: int, end: int) -> None:
        if not self.due(end):
            return
        if self.keep_cached:
            start_writeback(fd, self._marks[1], end - self._marks[1])
        else:
            drop_cached(fd, self._marks[0], end - self._marks[0])
        self._marks = (self._marks[1], end)
