"""Benchmark: the first-order slope tap inside the aggregation, at a real size (issue 29: aggregation + publish).

What the server's aggregation phase does with scoring on and LoRA submissions, without the checkpoint writer:
StoredDeltas over the encoded payloads -> SlopeTap (the base's gradient, spilled to disk as the server keeps it
between a publish and the next round) -> DeltaSoup (mean) with a sink that drops the aggregate. Prints JSON:
the aggregation's seconds, the tap's own seconds (`SlopeTap.seconds`), the spill's bytes, the slopes.

    python benchmarks/slope_tap.py --model DIR [--repeats 2]

The gradient is random (the tap's cost does not depend on its values), written the way `base_gradient`
writes it. Run it with PYTHONPATH set to another checkout to compare that checkout's tap.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import lora_deltas  # noqa: E402

from zoo_gym import codec  # noqa: E402
from zoo_gym.aggregation import DeltaSoup, SoupConfig  # noqa: E402
from zoo_gym.rewards.first_order import SlopeTap  # noqa: E402
from zoo_gym.evaluation.spill import SpilledTensors  # noqa: E402
from zoo_gym.server.rounds.publish import StoredDeltas  # noqa: E402
from zoo_gym.io.safetensors_reader import SafetensorsReader  # noqa: E402


def spilled_gradient(shapes: dict[str, tuple[int, ...]], directory: Path) -> SpilledTensors:
    """A random float32 gradient of every tensor, spilled as `base_gradient` spills it (the spill's default)."""
    spill = SpilledTensors(directory)
    g = torch.Generator().manual_seed(5)
    for name, shape in shapes.items():
        spill.put(name, torch.randn(shape, generator=g) * 1e-4)
        spill.alias(name, name, torch.Size(shape), torch.float32)
    return spill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a model directory (benchmarks/scale.py builds one)")
    ap.add_argument("--contributors", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="aggregations timed (a fresh spill each)")
    ap.add_argument("--work", type=Path, help="where the spill goes (default: a temporary directory)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    with SafetensorsReader(args.model / "model.safetensors") as r:
        shapes = r.shapes()
    deltas = lora_deltas(args.model, n=args.contributors, rank=args.rank, rms=2e-5)
    payloads = [codec.encode(d, codec="lora") for d in deltas]
    del deltas
    ids = [f"c{i}" for i in range(args.contributors)]
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-tap-"))
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        spill = spilled_gradient(shapes, work)
        spill_s = time.perf_counter() - t0
        tap = SlopeTap(StoredDeltas(payloads, ids, shapes), spill)
        t0 = time.perf_counter()
        DeltaSoup(SoupConfig.from_mapping({"aggregator": "mean"})).run(tap, lambda name, agg: None)
        seconds = time.perf_counter() - t0
        slopes, _ = tap.result(scales=[1.0] * args.contributors)
        runs.append({"aggregation_s": seconds, "tap_s": tap.seconds, "spill_write_s": spill_s, "slopes": slopes})
        spill.close()
    stored = inspect.signature(SpilledTensors).parameters.get("stored_dtype")
    report = {"model": str(args.model), "params": sum(torch.Size(s).numel() for s in shapes.values()),
              "contributors": args.contributors, "rank": args.rank, "torch_threads": torch.get_num_threads(),
              "spill_dtype": str(stored.default) if stored is not None else "float32",
              "best_aggregation_s": min(r["aggregation_s"] for r in runs),
              "best_tap_s": min(r["tap_s"] for r in runs), "runs": runs}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
