"""Bounds on server-streamed calls (checkpoint downloads, ledger streams), so unread streams cannot hold
the threads health checks and GetRound need.

A stream takes a slot without waiting (`max_downloads`; none free: RESOURCE_EXHAUSTED "server busy ...
retry later" at once, which clients retry; the servicer adds `max_downloads` threads to the pool), and a
watchdog cancels it once its reader has taken nothing for `idle_timeout` seconds: the blocked send
returns, the handler ends and the slot comes back. Stalls are seen from the generator side: grpcio asks
for the next message only once the previous one is sent. Why: docs/design/transport.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from zoo_gym.proto.busy import busy_message
from zoo_gym.server.errors import ResourceExhausted

_WATCH_EVERY_S = 0.5


class DownloadSlots:
    def __init__(self, *, max_streams: int, idle_timeout: float) -> None:
        self.max_streams, self.idle_timeout = max_streams, idle_timeout
        self._slots = threading.BoundedSemaphore(max_streams)
        self._lock = threading.Lock()
        self._active: dict[int, list] = {}  # id -> [context, monotonic time of the last hand-over]
        self._watchdog: threading.Thread | None = None

    def stream(self, context, items: Iterator[Any], *, what: str = "download") -> Iterator[Any]:
        """Yield `items` to grpc on a slot, cancelling the call if its reader stalls. ResourceExhausted
        (before anything is sent) when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(busy_message(f"{self.max_streams} downloads are in progress"))
        entry = [context, time.monotonic()]
        key = id(entry)
        with self._lock:
            self._active[key] = entry
            self._start_watchdog()
        try:
            for item in items:
                entry[1] = time.monotonic()
                yield item
            entry[1] = time.monotonic()
        finally:
            with self._lock:
                self._active.pop(key, None)
            self._slots.release()

    def _start_watchdog(self) -> None:  # under self._lock
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="download-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            time.sleep(_WATCH_EVERY_S)
            now = time.monotonic()
            with self._lock:
                if not self._active:  # nothing to watch: end; the next stream starts a new watchdog
                    self._watchdog = None
                    return
                stalled = [e for e in self._active.values() if now - e[1] > self.idle_timeout]
            for context, _ in stalled:
                context.cancel()  # wakes the send the handler waits on; the generator's finally frees the slot
