"""Where the server's streamed evaluation and scoring peak, phase by phase, in one process.

Builds the server's `ServerEvaluator` on a checkpoint directory (e.g. the model `benchmarks/scale.py --work DIR`
built, DIR/model) and runs `heldout_loss()` (the scoring gradient, spilled to disk, plus the no-grad forward over
the other validation examples), sampling VmRSS every 10 ms. Phases: load (the streamed model), forward (the
gradient pass's forward), backward (from the first recompute on), head (after the last layer's backward: the
output layer's and embedding's gradient), rest (the no-grad held-out forward). Prints JSON: each phase's seconds
and peak RSS / fp32 model bytes, and the RSS before it.

    python benchmarks/streamed_memory.py MODEL_DIR [--examples 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    def __init__(self, period: float = 0.01) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), _rss()))
            time.sleep(period)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def peak(self, t0: float, t1: float) -> int:
        return max((b for t, b in self.samples if t0 <= t <= t1), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--examples", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from zoo_gym import gym_train
    from zoo_gym.evaluation.streamed_model import stream_of
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator

    torch.set_num_threads(2)
    with open(args.model_dir / "config.json") as f:
        cfg = json.load(f)
    examples = gym_train.default_validation_examples(n=args.examples)
    marks: dict[str, float] = {}
    s = Sampler()
    marks["start"] = time.monotonic()
    start_rss = _rss()
    with tempfile.TemporaryDirectory() as spill:
        ev = ServerEvaluator(args.model_dir, examples, spill_dir=Path(spill))
        marks["loaded"] = time.monotonic()
        stream = stream_of(ev.base.model)
        load = stream.load

        def marking(i: int) -> None:
            if stream._recomputing and "backward" not in marks:  # noqa: SLF001 - the profile's own probe
                marks["backward"] = time.monotonic()
            if stream._recomputing and i == 0:  # noqa: SLF001
                marks["last_layer_backward"] = time.monotonic()
            load(i)

        stream.load = marking
        g = ev.gradient()
        marks["gradient"] = time.monotonic()
        loss = ev.heldout_loss()
        marks["rest"] = time.monotonic()
    s.stop()
    t = marks
    spans = {"load": (t["start"], t["loaded"]), "forward": (t["loaded"], t["backward"]),
             "backward": (t["backward"], t["last_layer_backward"]), "head": (t["last_layer_backward"], t["gradient"]),
             "rest": (t["gradient"], t["rest"])}
    n_params = sum(p.numel() for p in {id(p): p for p in ev.base.model.parameters()}.values())
    fp32 = 4 * n_params
    out = {"model": cfg.get("model_type"), "hidden_size": cfg.get("hidden_size"), "params": n_params,
           "fp32_bytes": fp32, "examples": args.examples, "scoring_tokens": g.tokens, "heldout_loss": loss,
           "base_loss": g.base_loss, "gradient_norm": g.norm, "start_rss_over_fp32": start_rss / fp32,
           "peak_rss_over_fp32": max(b for _, b in s.samples) / fp32,
           "phases": {k: {"seconds": b - a, "peak_rss_over_fp32": s.peak(a, b) / fp32} for k, (a, b) in spans.items()}}
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
