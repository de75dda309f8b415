"""Streaming gigabytes through files without growing the page cache by their size.

A publish writes the next checkpoint and its master (2.1 GB at Qwen3-0.6B's size) and the scoring pass
spills the model-sized gradient (2.4 GB); nobody reads those back soon, or only once. Left to the kernel,
each would grow the page cache by its size. On this project's 2-core VM that growth was most of their
cost: memory the kernel has not touched in the last ~3 s is handed back to the hypervisor, and touching
it again costs ~2 s/GiB (1 GiB of fresh memory: 2.5 s; the same memory again: 0.07 s). Dropping the
pages as the stream goes lets the next writes reuse them. Elsewhere it keeps a publish from evicting
what the server does read often. Writes now bypass the cache altogether where the file system allows
(O_DIRECT, zoo_gym/direct_writes.py); this file serves the reads, and the writes where it does not.

`StreamedRanges` does this for a file written front to back: every `step` bytes it hands the new pages
to writeback and drops the previous step's (clean by then), so at most two steps stay cached.
"""

from __future__ import annotations

import os

DROP_STEP = 64 << 20  # bytes between releases


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop a file range's clean pages from the page cache and to start writing back
    its dirty ones (which the next call for the range then drops); length 0: to the end of the file. A
    hint: nothing happens where the platform has no posix_fadvise."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class StreamedRanges:
    """Call `written(fd, end)` after writing a file up to byte `end` (front to back)."""

    def __init__(self, step: int | None = None) -> None:
        self.step = DROP_STEP if step is None else step
        self._marks = (0, 0)  # (start of the range handed to writeback a step ago, end of it)

    def due(self, end: int) -> bool:
        """Whether a file written up to `end` has a step's worth of pages not yet handed to writeback."""
        return end - self._marks[1] >= self.step

    def written(self, fd: int, end: int) -> None:
        if self.due(end):
            drop_cached(fd, self._marks[0], end - self._marks[0])
            self._marks = (self._marks[1], end)
