"""The server gives freed tensor buffers back: after many threads each allocate and free a tensor of a varying
size with a small survivor allocated after it (the upload checks' and a publish's pattern), its RSS is where it
started; without the setting the same work keeps what it freed."""

from __future__ import annotations

import subprocess
import sys

import pytest

_WORK = r"""
import sys, threading
import torch
from zoo_gym.allocator import settle_allocator

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "settled":
    assert settle_allocator()
keep = []
base = rss_mb()

def work(t):
    for i in range(300):
        a = torch.empty((1 << 18) + 4096 * ((i * 7 + t) % 64))  # 1.0-1.25 MB, a different size each time
        a.fill_(1.0)
        keep.append(torch.empty(64))  # a small survivor allocated after it
        del a

threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(rss_mb() - base)
"""


def _grew_mb(mode: str) -> float:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no MALLOC_* of the caller's
    done = subprocess.run([sys.executable, "-c", _WORK, mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensor_buffers_are_returned_to_the_system():
    kept = _grew_mb("default")
    settled = _grew_mb("settled")
    assert kept > 64, f"the pattern no longer fragments this libc's heap ({kept:.0f} MB kept): revise the test"
    assert settled < 24, f"settled allocator kept {settled:.0f} MB of freed buffers"
