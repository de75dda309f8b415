"""`gym-server serve` stops on SIGTERM even when the kernel hands the signal to one of its other threads (gRPC's):
it once waited forever, and a test's `terminate()` timed out (tests/e2e/test_crash_recovery.py, CI)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import platform

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                                reason="SYS_tgkill is 234 on Linux x86-64 only")


def test_sigterm_delivered_to_a_non_main_thread_stops_the_server(tmp_path: Path):
    from zoo_gym.server.genesis import init_state

    state = tmp_path / "state"
    init_state(state, base_model="tiny").engine.dispose()
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "zoo_gym.server", "serve", "--insecure", "--state-dir", str(state),
                             "--port", "0", "--port-file", str(port_file)], stderr=open(tmp_path / "log", "w"))
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "log").read_text()[-2000:]
            time.sleep(0.2)
        assert port_file.read_text().strip(), "gym-server did not listen"
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "the server runs gRPC threads"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(234, proc.pid, others[0], signal.SIGTERM) == 0  # SYS_tgkill (x86-64): to that thread
        assert proc.wait(timeout=30) == 0, (tmp_path / "log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
