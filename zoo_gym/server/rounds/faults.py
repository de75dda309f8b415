"""Fault injection for the crash-recovery tests: with `ZOO_GYM_FAULT_AT=<point>` in its environment the
server kills itself (SIGKILL: no cleanup, no flush) when it reaches that point of publishing a round.

Points, in the order a round passes them (see publish.py):
  aggregated    the merged weights exist in memory; nothing of the round is written
  settled       scores and the payout plan exist in memory; nothing is written
  blob-written  the new checkpoint's blob is in the store; no row references it yet
  committed     the ledger entries, reputations, checkpoint row and next round are committed
With `ZOO_GYM_RAY_TASK_GATE=DIR` in a Ray worker's environment, each task of a round (`ray_engine.run_block`)
first touches `DIR/task.<tensor>@<first element>.<pid>` and waits (bounded) for `DIR/go`: before it reads or
writes anything, so a test can kill that worker, its node or the coordinator, or change the storage, at a known step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT_ENV = "ZOO_GYM_FAULT_AT"
POINTS = ("aggregated", "settled", "blob-written", "committed")
TASK_GATE_ENV = "ZOO_GYM_RAY_TASK_GATE"


def crash_point(point: str) -> None:
    """Die here when the environment names this point (a no-op otherwise)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def task_gate(label: str, timeout: float = 600.0) -> None:
    """A Ray task's gate (a no-op without ZOO_GYM_RAY_TASK_GATE, or once DIR/go exists): say `label` and this
    process's pid in DIR, then wait for DIR/go, at most `timeout` seconds."""
    gate = os.environ.get(TASK_GATE_ENV)
    if not gate or (go := Path(gate) / "go").exists():
        return
    (Path(gate) / f"task.{label}.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
