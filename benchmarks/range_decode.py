"""Benchmark: a row block of a wide tensor decoded from its rows alone (`codec.decode_rows`) against the whole
tensor decoded and sliced (what a Ray task and a row-blocked pass did for the dense codecs before).

    python benchmarks/range_decode.py                     # -> benchmarks/results/range_decode.json
    python benchmarks/range_decode.py --rows 4096 --cols 64 --contributors 2 --out /tmp/rd.json   # a smoke run

A tensor of `--rows` x `--cols` (default 49152 x 576: SmolLM2-135M's embedding), one upload per contributor in
each dense codec (fp16, bf16, int8 per row, int4 in groups of 128), read in blocks of `--block-rows` rows through
`StoredDeltas.stacked_block` (the Ray engine's read) from blob files, as the engine maps them. Baseline: the same
blocks with each contributor's tensor decoded whole (`codec.decode_tensor`) and sliced. Both must give the same
numbers (checked). Reports seconds for all blocks and the peak of one block's extra memory (the whole decoded
tensor, or the rows), and the ratio baseline / rows.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import pathlib
import platform
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from zoo_gym import codec  # noqa: E402
from zoo_gym.server.rounds.stored_deltas import StoredDeltas  # noqa: E402

CODECS = (("fp16", None), ("bf16", None), ("int8", None), ("int4", 128))


def _blocks(stored: StoredDeltas, name: str, rows: int, cols: int, block_rows: int) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    last = None
    for r0 in range(0, rows, block_rows):
        last = stored.stacked_block(name, r0 * cols, min(rows, r0 + block_rows) * cols)
    return time.perf_counter() - t, last


def _whole_then_slice(stored: StoredDeltas, name: str, rows: int, cols: int, block_rows: int,
                      ) -> tuple[float, torch.Tensor]:
    """The path before range decode: every contributor's tensor decoded whole for each block."""
    t = time.perf_counter()
    last = None
    for r0 in range(0, rows, block_rows):
        r1 = min(rows, r0 + block_rows)
        out = torch.empty((stored.n, (r1 - r0) * cols))
        for i in range(stored.n):
            payload, manifest = stored._tensor(i, name)
            out[i].copy_(codec.decode_tensor(payload, name, manifest=manifest).reshape(rows, cols)[r0:r1].reshape(-1))
        last = out
    return time.perf_counter() - t, last


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--cols", type=int, default=576)
    ap.add_argument("--block-rows", type=int, default=4096)
    ap.add_argument("--contributors", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "range_decode.json")
    args = ap.parse_args(argv)
    rows, cols, n = args.rows, args.cols, args.contributors
    shapes = {"embed.weight": (rows, cols)}
    doc: dict = {"benchmark": "range_decode", "rows": rows, "cols": cols, "block_rows": args.block_rows,
                 "blocks": math.ceil(rows / args.block_rows), "contributors": n,
                 "machine": {"python": platform.python_version(), "torch": torch.__version__,
                             "threads": torch.get_num_threads()}, "codecs": {}}
    with tempfile.TemporaryDirectory(prefix="zoo-range-decode-") as tmp:
        for method, group in CODECS:
            maps = []
            for i in range(n):
                x = torch.randn(shapes["embed.weight"], generator=torch.Generator().manual_seed(i)) * 1e-3
                path = pathlib.Path(tmp) / f"{method}-{i}.zgd"
                path.write_bytes(codec.encode({"embed.weight": x}, codec=method, group_size=group))
                with open(path, "rb") as f:
                    maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            stored = StoredDeltas(maps, [str(i) for i in range(n)], shapes, cache_bytes=0)
            base_s, base_last = _whole_then_slice(stored, "embed.weight", rows, cols, args.block_rows)
            rows_s, rows_last = _blocks(stored, "embed.weight", rows, cols, args.block_rows)
            assert torch.equal(base_last, rows_last), method
            doc["codecs"][method] = {
                "whole_then_slice_s": round(base_s, 3), "rows_alone_s": round(rows_s, 3),
                "speedup": round(base_s / rows_s, 2),
                "extra_bytes_whole": 4 * rows * cols, "extra_bytes_rows": 4 * min(rows, args.block_rows) * cols}
            print(f"{method}: whole then slice {base_s:.2f} s, rows alone {rows_s:.2f} s", file=sys.stderr)
            del stored
            for m in maps:
                m.close()
    text = json.dumps(doc, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return doc


if __name__ == "__main__":
    main()
