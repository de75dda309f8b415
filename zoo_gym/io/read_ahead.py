"""Read the next item of a known order on a thread while the caller works on this one.

The server reads gigabytes a tensor at a time in an order it knows beforehand: the base checkpoint and its
master's low halves as a publish adds the aggregate (server/store/checkpoint_writer.py), the spilled scoring
gradient as the slope tap takes its slopes (evaluation/spill.py). `os.preadv` releases the GIL, so the disk
works beside the arithmetic. Written here because the standard library's executors would keep a thread per
reader alive past its last read; this starts one short thread per item and holds at most one read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """`get(key)` returns `read(key)`; when `key` is in `order`, the next key of the order is then read on a
    thread, unless `size(next) > max_bytes` (read when asked for: one such item at most beside the caller's).
    Keys out of order are read on demand, and an unused read ahead is dropped. A read's error is raised by
    the `get` that asks for its key."""

    def __init__(self, read: Callable[[Hashable], T], order: Sequence[Hashable], *,
                 size: Callable[[Hashable], int] = lambda key: 0, max_bytes: int = 256 << 20) -> None:
        self._read, self._size, self._max = read, size, max_bytes
        self._order = list(order)
        self._at = {key: i for i, key in enumerate(self._order)}
        self._pending: tuple[Hashable, threading.Thread, list] | None = None
        self.read_ahead = 0  # reads that were ahead when asked for (tests, benchmarks)
        self._start(0)

    def _start(self, i: int) -> None:
        if i >= len(self._order) or self._size(self._order[i]) > self._max:
            return
        key, box = self._order[i], []

        def run() -> None:
            try:
                box.append(self._read(key))
            except BaseException as exc:  # noqa: BLE001 - raised by the get() that asks for it
                box.append(exc)

        thread = threading.Thread(target=run, name="read-ahead", daemon=True)
        thread.start()
        self._pending = (key, thread, box)

    def get(self, key: Hashable) -> T:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].join()
        if pending is not None and pending[0] == key:
            got = pending[2][0]
            if isinstance(got, BaseException):
                raise got
            self.read_ahead += 1
        else:
            got = self._read(key)
        if key in self._at:
            self._start(self._at[key] + 1)
        return got

    def close(self) -> None:
        """Wait for a read still running (its result is dropped)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].join()
