"""Give a finished working set's memory back to the operating system (a training run, the server's scoring
gradient, a model the server drops before loading the next).

After `train()` returns, its model, optimizer state and activations are garbage, but glibc keeps freed
heap pages inside the process (its mmap threshold grows with every large free, so later large tensors
land on the heap), and the resident size stays near the training peak while the client only waits for
the server (measured on the server at Qwen3-0.6B's size: 0.5x the float32 model stayed resident after the
scoring gradient). `gc.collect()` drops Python's cycles (trainer <-> model callbacks); `malloc_trim(0)` hands the
free heap back. On a libc without `malloc_trim` (musl, macOS) the second step is skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def release_memory() -> bool:
    """Collect garbage and trim the C heap; True when the heap was trimmed."""
    gc.collect()
    return trim_heap()


def trim_heap() -> bool:
    """``malloc_trim(0)``: free pages of the C heap go back to the system; True when some did."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
