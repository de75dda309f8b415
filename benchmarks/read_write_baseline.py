"""The read + write baseline of benchmarks/scale.py alone, warm and cold, for runs made before it measured both.

A publish reads its base from a blob written past the page cache (O_DIRECT), so its like-for-like baseline
reads the model file cold; scale.py's runs of 2026-11-28 took the warm figure only (the file had just been
read). Prints JSON: per model directory, the best of 2 of each.

    python benchmarks/read_write_baseline.py DIR [DIR ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import read_write_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="model directories (model.safetensors inside)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory(dir=args.models[0].parent) as work:
        for m in args.models:
            f = m / "model.safetensors"
            res[str(m)] = {"bytes": f.stat().st_size, "read_write_model_s": read_write_seconds(f, Path(work)),
                           "read_write_model_cold_s": read_write_seconds(f, Path(work), cold=True)}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
