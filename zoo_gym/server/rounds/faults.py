"""Fault injection for the crash-recovery tests: with `ZOO_GYM_FAULT_AT=<point>` in its environment the
server kills itself (SIGKILL: no cleanup, no flush) when it reaches that point of publishing a round.

Points, in the order a round passes them (see publish.py):
  aggregated    the merged weights exist in memory; nothing of the round is written
  settled       scores and the payout plan exist in memory; nothing is written
  blob-written  the new checkpoint's blob is in the store; no row references it yet
  committed     the ledger entries, reputations, checkpoint row and next round are committed
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "ZOO_GYM_FAULT_AT"
POINTS = ("aggregated", "settled", "blob-written", "committed")


def crash_point(point: str) -> None:
    """Die here when the environment names this point (a no-op otherwise)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
