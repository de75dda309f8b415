"""Write a file of gigabytes front to back without the page cache (O_DIRECT), where the platform allows.

O_DIRECT wants the buffer, the file offset and the length aligned to the device's block, so writes are
gathered in two page-aligned buffers (anonymous mmaps) of `BUFFER` bytes: a background thread writes one
while the caller fills the other. The last, partial buffer is written through the page cache once
O_DIRECT is switched off (the offset is aligned by then). Where O_DIRECT is refused (tmpfs, macOS, some
network file systems) the file goes through the page cache, its pages dropped as the stream goes
(`page_cache.StreamedRanges`). Why: docs/design/checkpoint-publishing.md.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

import numpy as np

from zoo_gym.io.page_cache import StreamedRanges, drop_cached

BUFFER = 8 << 20  # bytes per aligned buffer: a multiple of any block size (<= 64 KiB)


def try_direct(fd: int) -> bool:
    """Switch O_DIRECT on for `fd`; False where the platform or the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError:  # EINVAL: the file system has no direct I/O
        return False
    return True


class DirectWriter:
    """Sequential writes to `fd` (opened for writing, at offset 0 of an empty file) with `write`, then
    `finish()` (everything written and fsynced) and `close()` (closes `fd` if `owns_fd`). Not
    thread-safe: one caller thread.
    `direct`: whether the writes bypass the page cache (O_DIRECT taken); False after a `flush()`."""

    def __init__(self, fd: int, *, try_o_direct: bool = True, owns_fd: bool = True) -> None:
        self.fd, self.owns_fd = fd, owns_fd
        self.direct = try_o_direct and try_direct(fd)
        self.size = 0
        self.closed = False
        self._error: BaseException | None = None
        if self.direct:
            self._buffers = [mmap.mmap(-1, BUFFER), mmap.mmap(-1, BUFFER)]  # page-aligned
            self._views = [np.frombuffer(b, dtype=np.uint8) for b in self._buffers]
            self._current, self._filled = 0, 0
            self._pending: threading.Thread | None = None
        else:
            self._streamed = StreamedRanges()

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if not self.direct:
            _write_all(self.fd, view)
            self._streamed.written(self.fd, self.size)
            return
        src = np.frombuffer(view, dtype=np.uint8) if len(view) else None
        pos = 0
        while pos < len(view):
            n = min(BUFFER - self._filled, len(view) - pos)
            # numpy copies without the GIL, so the main thread keeps aggregating meanwhile
            np.copyto(self._views[self._current][self._filled:self._filled + n], src[pos:pos + n])
            self._filled += n
            pos += n
            if self._filled == BUFFER:
                self._hand_over()

    def _hand_over(self) -> None:
        """Write the full current buffer in the background and continue in the other one."""
        self._wait()
        buf = self._buffers[self._current]
        self._pending = threading.Thread(target=self._write_buffer, args=(buf,), name="direct-write", daemon=True)
        self._pending.start()
        self._current, self._filled = 1 - self._current, 0

    def _write_buffer(self, buf: mmap.mmap) -> None:
        try:
            _write_all(self.fd, memoryview(buf))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by _wait
            self._error = exc

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Everything written so far reaches the file (readable through its path). A direct writer
        writes its partial buffer through the page cache and stays a plain writer from then on."""
        if not self.direct:
            return
        self._wait()
        tail = memoryview(self._buffers[self._current])[:self._filled]
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        _write_all(self.fd, tail)
        tail.release()
        self.direct = False
        self._streamed = StreamedRanges()
        self._release_buffers()

    def finish(self) -> None:
        """flush + fsync; the written range leaves the page cache."""
        self.flush()
        os.fsync(self.fd)
        drop_cached(self.fd)

    def _release_buffers(self) -> None:
        self._views = []
        for b in self._buffers:
            try:
                b.close()
            except BufferError:  # a failed write's traceback still holds a view of it: freed with that traceback
                pass
        self._buffers = []

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.direct:
            try:
                self._wait()
            except BaseException:  # noqa: BLE001 - closing after a failure: the error was raised before
                pass
            self._release_buffers()
            self.direct = False
        if self.owns_fd:
            os.close(self.fd)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


class QueuedWrites:
    """`writer.write` on a thread of its own, in order, with at most `max_bytes` handed over and not yet written:
    the caller goes on computing while the disk writes (a DirectWriter's two buffers overlap only 8 MiB, so
    a burst of gradients waited for the disk). `drain()` before touching `writer` again; errors surface there
    or in the next `write`."""

    def __init__(self, writer: DirectWriter, *, max_bytes: int) -> None:
        self.writer, self.max_bytes = writer, max_bytes
        self._queue: list[memoryview] = []
        self._queued = 0  # bytes handed over and not yet written
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def write(self, data: memoryview) -> None:
        """Hand `data` over (it must stay unchanged until written: the view keeps its memory alive)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self._queue
                                or self._queued + len(data) <= self.max_bytes)
            self._raise()
            self._queue.append(data)
            self._queued += len(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="queued-writes", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                data = self._queue[0]
            try:
                self.writer.write(data)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by write or drain
                with self._cond:
                    self._error = exc
                    self._queue.clear()
                    self._queued = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.pop(0)
                self._queued -= len(data)
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until everything handed over is written."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue)
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
