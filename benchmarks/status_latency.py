"""`gym-server status` latency (issue 30 item 7: under 2 s on an idle machine, no training imports).

Runs the real console script against a real state directory (`gym-server init` of the tiny base in a
temporary directory unless --state-dir is given), alternating with `python -c pass` as the baseline in the
same run; reports medians of wall and CPU seconds (CPU from wait4: what the command costs whatever else
runs on the machine), their ratios, the load average, and whether torch/transformers/peft were imported.

Run: PYTHONPATH=. python benchmarks/status_latency.py [--runs 9] [--out benchmarks/results/status_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HEAVY = ("torch", "transformers", "peft", "trl", "datasets", "accelerate")


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one run; raises when it fails."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - start
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{cmd} exited {p.returncode}: {p.stderr.read().decode()[-2000:]}")
    p.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime


def _imported(script: str, state_dir: str) -> dict:
    """Which heavy packages the command imports, and where zoo_gym came from (the tree measured)."""
    code = ("import runpy, sys; sys.argv = ['gym-server', 'status', '--state-dir', %r]\n"
            "try:\n    runpy.run_path(%r, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "import zoo_gym\nprint('@@', zoo_gym.__file__, *sorted(m for m in %r if m in sys.modules))"
            % (state_dir, script, HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("@@")).split()[1:]
    return {"zoo_gym": line[0], "heavy_imports": line[1:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--state-dir", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    script = str(pathlib.Path(sys.executable).parent / "gym-server")
    with tempfile.TemporaryDirectory() as tmp:
        state = args.state_dir or pathlib.Path(tmp) / "state"
        if args.state_dir is None:
            subprocess.run([script, "init", "--state-dir", str(state)], check=True, stdout=subprocess.DEVNULL)
        status_cmd = [script, "status", "--state-dir", str(state)]
        baseline_cmd = [sys.executable, "-c", "pass"]
        _timed(status_cmd)  # warm the page cache once, as an operator's second call would be
        load_before = os.getloadavg()[0]
        base, stat = [], []
        for _ in range(args.runs):
            base.append(_timed(baseline_cmd))
            stat.append(_timed(status_cmd))
        load_after = os.getloadavg()[0]
        imports = _imported(script, str(state))
    med = {name: (statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs))
           for name, xs in (("status", stat), ("baseline", base))}
    doc = {
        "command": "gym-server status --state-dir STATE (tiny base, round 1 open)", "runs": args.runs,
        "status_wall_s_median": round(med["status"][0], 3), "status_cpu_s_median": round(med["status"][1], 3),
        "baseline_wall_s_median": round(med["baseline"][0], 3), "baseline_cpu_s_median": round(med["baseline"][1], 3),
        "wall_ratio_vs_baseline": round(med["status"][0] / med["baseline"][0], 2),
        "cpu_ratio_vs_baseline": round(med["status"][1] / med["baseline"][1], 2),
        "status_wall_s_all": [round(w, 3) for w, _ in stat], "load_average_1m": [load_before, load_after],
        "cpus": os.cpu_count(), **imports,
        "under_2s_cpu": med["status"][1] < 2.0, "under_2s_wall": med["status"][0] < 2.0,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
