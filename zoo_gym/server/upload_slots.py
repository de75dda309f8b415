"""Bounds on SubmitDelta streams, so that uploads can never take the threads other RPCs need.

grpcio's synchronous server runs each RPC on a thread of one pool and queues the RPC when the pool is
busy, so streams that send nothing used to take every thread and health checks queued behind them.
A stream now needs a slot before it holds anything, and a slot is taken without waiting:

- a *pending-header* slot (`max_pending_headers` in all, `max_pending_headers_per_peer` per peer
  address) from the moment the stream opens until its signed header verifies; the header must arrive
  within `header_timeout` seconds;
- then an *upload* slot (`max_uploads` in all, and one per contributor through `UploadGate`) until the
  stream ends; the pending-header slot is handed back at that moment.

No free slot: RESOURCE_EXHAUSTED at once with a "server busy ... retry later" message (`proto/busy.py`),
never a queue. The servicer sizes the pool as uploads + pending headers + a reserve, so the reserve is
always left to health, GetRound, Register, balance and ledger queries.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from zoo_gym.proto.busy import busy_message
from zoo_gym.server.errors import ResourceExhausted


def peer_host(peer: str) -> str:
    """The address part of grpc's `context.peer()` ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4")."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class UploadSlots:
    """The server-wide counts of pending-header and upload slots (see the module docstring)."""

    def __init__(self, *, max_uploads: int, max_pending_headers: int, max_pending_headers_per_peer: int,
                 gate) -> None:
        self._uploads = threading.BoundedSemaphore(max_uploads)
        self._pending = threading.BoundedSemaphore(max_pending_headers)
        self._per_peer_limit = max_pending_headers_per_peer
        self._per_peer: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.gate = gate  # handlers.UploadGate: one upload in flight per contributor
        self.max_uploads = max_uploads
        self.max_pending_headers = max_pending_headers

    @contextmanager
    def admit(self, peer: str) -> Iterator[Admission]:
        """A pending-header slot for a new stream from `peer`, for the `with` block; ResourceExhausted if none."""
        host = peer_host(peer)
        with self._lock:
            if self._per_peer[host] >= self._per_peer_limit:
                raise ResourceExhausted(busy_message(
                    f"{self._per_peer_limit} uploads from your address are still waiting for their header"))
            if not self._pending.acquire(blocking=False):
                raise ResourceExhausted(busy_message(
                    f"{self.max_pending_headers} uploads are waiting for their header"))
            self._per_peer[host] += 1
        admission = Admission(self, host)
        try:
            yield admission
        finally:
            admission.release_pending()

    def _release_pending(self, host: str) -> None:
        with self._lock:
            self._per_peer[host] -= 1
            if self._per_peer[host] <= 0:
                del self._per_peer[host]
            self._pending.release()


class Admission:
    """One stream's place: passed to `handlers.submit_delta` as its gate, whose `hold` is entered only
    after the header verified; that is when the stream trades its pending-header slot for an upload slot
    and `on_verified` runs (the servicer sets the upload's own time limits there)."""

    def __init__(self, slots: UploadSlots, host: str) -> None:
        self._slots, self._host = slots, host
        self._pending = True
        self.on_verified: Callable[[], None] = lambda: None

    def release_pending(self) -> None:
        if self._pending:
            self._pending = False
            self._slots._release_pending(self._host)

    @contextmanager
    def hold(self, contributor_id: str) -> Iterator[None]:
        slots = self._slots
        if not slots._uploads.acquire(blocking=False):
            raise ResourceExhausted(busy_message(f"{slots.max_uploads} uploads are in progress"))
        try:
            self.release_pending()
            with slots.gate.hold(contributor_id):
                self.on_verified()
                yield
        finally:
            slots._uploads.release()
