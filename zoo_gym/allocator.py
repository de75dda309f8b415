"""The server's allocator settings, made once at start: a long run of uploads and publishes must give its buffers back.

glibc raises its mmap threshold each time a large buffer is freed (up to 32 MB), after which tensor-sized
buffers come from per-thread heaps that small survivors pin: the server's RSS kept what its busiest moment freed
(the 1,000-contributor round's peak was 1.24 GiB for a live heap of 0.63 GB). A fixed threshold keeps large
buffers mapped and returned on free. A process-wide switch only the allocator has, hence ctypes; an operator's own
MALLOC_* settings win. (MKL's per-thread buffer cache stays on: without it every matrix product maps and faults in
fresh buffers, a third more CPU in a publish.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, kept instead of raised
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def settle_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds; True when glibc took the setting."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # the operator tuned glibc themselves
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to settle
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD))
