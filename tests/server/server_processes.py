"""Shared by the server tests that run `gym-server serve` as a real process: how one is stopped."""

from __future__ import annotations

import signal
import subprocess


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server's clean shutdown), then kill it if it has not exited 30 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
