"""What touching memory costs on this machine: fresh, just freed, and freed a few seconds ago (JSON).

On the VM this project is developed on, memory the guest has not touched for a few seconds goes back to
the hypervisor (free page reporting), and touching it again costs about as much as a slow disk. That
decides how a server that streams gigabytes should treat the page cache (zoo_gym/io/page_cache.py): every
GB a publish adds to the cache is fresh memory.

    python benchmarks/fresh_memory.py [--gib 1] [--waits 0 1 3 10]

Prints seconds to allocate and touch `--gib` GiB (numpy ones) first, then again after each wait; the
ratio is against the fastest touch of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def touch_seconds(gib: float) -> float:
    t0 = time.perf_counter()
    a = np.ones(int(gib * (1 << 28)), dtype=np.float32)  # every page written
    dt = time.perf_counter() - t0
    del a
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--waits", type=float, nargs="+", default=[0, 1, 3, 10])
    args = ap.parse_args()
    runs = [{"wait_s": None, "seconds": touch_seconds(args.gib)}]  # first touch in this process
    for w in args.waits:
        time.sleep(w)
        runs.append({"wait_s": w, "seconds": touch_seconds(args.gib)})
    fastest = min(r["seconds"] for r in runs)
    for r in runs:
        r["gib_per_s"] = args.gib / r["seconds"]
        r["over_fastest"] = r["seconds"] / fastest
    print(json.dumps({"gib": args.gib, "cpus": os.cpu_count(), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
