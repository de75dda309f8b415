"""Bounds on SubmitDelta streams, so that uploads can never take the threads other RPCs need.

A stream takes a slot before it holds anything, without waiting: a *pending* slot (`max_pending_headers`
in all, `max_pending_headers_per_peer` per peer address, shared with unary calls waiting for their
request: first_message.py) from the moment it opens until its signed header verifies, which must arrive
within `header_timeout` seconds; then an *upload* slot (`max_uploads` in all, one per contributor through
`UploadGate`) until it ends, the pending slot handed back. No free slot: RESOURCE_EXHAUSTED "server
busy ... retry later" at once (`proto/busy.py`), never a queue. The servicer sizes the pool as uploads +
pending headers + a reserve, which is left to health, GetRound, Register, balance and ledger queries.
Why: docs/design/transport.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from zoo_gym.proto.busy import busy_message
from zoo_gym.server.errors import ResourceExhausted
from zoo_gym.server.transport.first_message import PendingSlots


class UploadSlots:
    """The server-wide upload slots, and the pending slots shared with every call (first_message.py)."""

    def __init__(self, *, max_uploads: int, pending: PendingSlots, gate) -> None:
        self._uploads = threading.BoundedSemaphore(max_uploads)
        self.pending = pending
        self.gate = gate  # handlers.UploadGate: one upload in flight per contributor
        self.max_uploads = max_uploads

    @contextmanager
    def admit(self, peer: str) -> Iterator[StreamSlot]:
        """A pending slot for a new stream from `peer`, for the `with` block; ResourceExhausted if none."""
        slot = StreamSlot(self, self.pending.take(peer))
        try:
            yield slot
        finally:
            slot.release_pending()


class StreamSlot:
    """One SubmitDelta stream's slot (not who may register: that is admission.py's `Admission`): a pending
    slot until its header verifies, then an upload slot. Passed to `handlers.submit_delta` as its gate,
    whose `hold` is entered only after the header verified; that is when the stream trades its pending
    slot for an upload slot and `on_verified` runs (the servicer sets the upload's own time limits there)."""

    def __init__(self, slots: UploadSlots, host: str) -> None:
        self._slots, self._host = slots, host
        self._pending = True
        self.on_verified: Callable[[], None] = lambda: None

    def release_pending(self) -> None:
        if self._pending:
            self._pending = False
            self._slots.pending.give_back(self._host)

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
