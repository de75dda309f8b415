"""Client streams with deadlines: a peer that stops sending cannot hold a server thread forever.

grpcio's synchronous server gives a handler a blocking request iterator and no per-stream idle
timeout (keepalive and `max_connection_idle` act on connections, not on a stream that is open but
silent). `BoundedStream` reads the iterator in a helper thread and hands items over through a small
queue, so the handler waits at most `idle_timeout` for the next item and at most until `deadline`
overall, then raises `DeadlineExceeded`; the first item (an upload's signed header) may be given a
shorter wait, `first_timeout`, so a stream that never sends one is dropped early. When the handler ends
the RPC (answer or abort), grpc ends the iterator, which ends the helper thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from zoo_gym.server.errors import DeadlineExceeded

_END = object()
NOT_YET = object()  # BoundedStream.poll: nothing arrived within the wait
_QUEUE_ITEMS = 2  # read-ahead: at most two chunks wait in memory per stream


class BoundedStream:
    """Iterate `source` with an idle timeout between items and an overall deadline (monotonic seconds)."""

    def __init__(self, source: Iterator[Any], *, idle_timeout: float, first_timeout: float | None = None,
                 what: str = "upload", first_what: str = "first message (the signed header)") -> None:
        self.idle_timeout = idle_timeout
        self.first_timeout = idle_timeout if first_timeout is None else min(first_timeout, idle_timeout)
        self.what, self.first_what = what, first_what
        self._first = True
        self._deadline = float("inf")
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_ITEMS)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(source,), name="stream-reader", daemon=True)
        self._thread.start()

    def set_deadline(self, seconds_from_now: float) -> None:
        self._deadline = time.monotonic() + seconds_from_now

    def close(self) -> None:
        """Stop handing items over (the reader thread ends with the RPC)."""
        self._closed.set()

    def _read(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - the RPC ended or the peer broke the stream
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        now = time.monotonic()
        idle = self.first_timeout if self._first else self.idle_timeout
        wait = min(idle, self._deadline - now)
        try:
            item = self._queue.get(timeout=max(wait, 0.0))
        except queue.Empty:
            self.close()
            if self._first and self._deadline - now > idle:
                raise DeadlineExceeded(f"the {self.what} sent nothing for {idle:g} s and was dropped: its "
                                       f"{self.first_what} must arrive within {idle:g} s") from None
            if self._deadline - now <= idle:
                raise DeadlineExceeded(f"the {self.what} did not finish within its time limit; a stream "
                                       "must keep at least the server's minimum rate (resend on a faster link)"
                                       ) from None
            raise DeadlineExceeded(f"the {self.what} sent nothing for {idle:g} s and was dropped; "
                                   "retry when the connection is stable") from None
        return self._hand_over(item)

    def poll(self, timeout: float) -> Any:
        """The next item if it arrives within `timeout` seconds, else `NOT_YET` (the stream stays open)."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return NOT_YET
        return self._hand_over(item)

    def _hand_over(self, item: Any) -> Any:
        self._first = False
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item
