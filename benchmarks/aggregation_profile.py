"""In-process timing of one publish's aggregation (DeltaSoup.run over StoredDeltas into a CheckpointWriter)
on L layers of Qwen3-0.6B's Linear shapes with 2 synthetic rank-8 LoRA deltas (codec auto -> lora).

    python benchmarks/aggregation_profile.py --layers 8 [--zoo /path/to/other/checkout] [--profile]

Per-element costs scale, so 8 layers (2/7 of 0.6B's Linear weights; the 512 MB decode cache then holds
about half of them) predict the 0.6B aggregation phase without a 0.6B model. Prints the seconds, the
written weights' sha256 (compare before/after: it must not change) and the contributors' norms.
"""

import argparse
import cProfile
import hashlib
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

H, I, NH, KV, HD = 1024, 3072, 16, 8, 128  # Qwen3-0.6B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--zoo", help="import zoo_gym from this directory (before/after)")
    ap.add_argument("--profile", action="store_true", help="cProfile the second run")
    args = ap.parse_args()
    if args.zoo:
        sys.path.insert(0, args.zoo)
    import torch
    from safetensors.torch import save_file

    from zoo_gym import codec
    from zoo_gym.aggregation import DeltaSoup, SoupConfig
    from zoo_gym.codec.lora import LoraFactors
    from zoo_gym.server.checkpoint_writer import CheckpointWriter
    from zoo_gym.server.publish import StoredDeltas

    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (NH * HD, H), p + "self_attn.k_proj.weight": (KV * HD, H),
                       p + "self_attn.v_proj.weight": (KV * HD, H), p + "self_attn.o_proj.weight": (H, NH * HD),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,)})
    work = Path(tempfile.mkdtemp(prefix="zoo-aggprof-"))
    base = work / "base"
    base.mkdir()
    torch.manual_seed(0)
    save_file({k: (torch.randn(s) * 0.02).to(torch.bfloat16) for k, s in shapes.items()},
              str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text("{}")
    payloads = []
    for i in range(2):
        g = torch.Generator().manual_seed(1000 + i)
        payloads.append(codec.encode({k: LoraFactors(A=torch.randn(8, s[1], generator=g) / 8 ** 0.5,
                                                     B=torch.randn(s[0], 8, generator=g) * 2e-5)
                                      for k, s in shapes.items() if len(s) == 2}, codec="auto"))

    class Blob:
        def write(self, b) -> None:
            pass

    for run in range(2):
        out = Path(tempfile.mkdtemp(dir=work))
        stored = StoredDeltas(payloads, ["a", "b"], shapes)
        w = CheckpointWriter(base, master=None, changed=stored.names(), out_dir=out, ckpt_blob=Blob(),
                             master_blob=Blob())
        pr = cProfile.Profile() if args.profile and run else None
        t0 = time.perf_counter()
        if pr:
            pr.enable()
        rep = DeltaSoup(SoupConfig.from_mapping({"aggregator": "mean"})).run(stored, w.sink)
        if pr:
            pr.disable()
        t1 = time.perf_counter()
        w.finish_weights()
        w.finish({})
        w.close()
        sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:12]
        print(f"aggregation {t1 - t0:.2f} s  weights sha256 {sha}  norms {[c.norm for c in rep.contributors]}")
        if pr:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
            print(s.getvalue())


if __name__ == "__main__":
    main()
