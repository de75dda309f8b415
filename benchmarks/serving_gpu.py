"""Serving BitDelta variants on a CUDA GPU against the memory bound (issues 32, 53): decode tokens per second of a
batch in which n distinct variants serve the rows (row i uses variant i mod n), for n = 1, 4, 16, 64 at batch 16
and 64 (n <= batch), beside the base alone and PEFT's mixed-LoRA batch, same run.

The bound: a decode step is memory-bound; a bf16 base reads 2 bytes a parameter, each distinct variant's signs
1/8 more, so a batch with n variants runs at most 16 / (16 + n) of the base alone. `bound_share` is the measured
ratio over that bound. LoRA: PEFT's `adapter_names=` batch of 16 rank-16 adapters on every decoder Linear, against
the base alone at batch 16. Model and variants as benchmarks/serving.py (a bf16 Qwen3 of `--size`'s dimensions,
random weights; variants of every decoder Linear, bitdelta groups of 128, held as gym-serve holds them: signs and
log8 scale codes), each Linear patched with serving.py's BitDeltaLinear (zoo_gym.serving.kernels.bitdelta_linear,
Triton on CUDA). Timing: CUDA synchronised wall time of `--steps` greedy decode steps after the prefill, fastest
of `--repeats`. `--device cpu` runs the same on the CPU path (a smoke test of the script, not a GPU figure).
The JSON ends with `targets`: bound_share by n (4, 16, 64; the lowest over the batches) and lora_16_over_base.

    python benchmarks/serving_gpu.py [--size 0.6b|tiny] [--batches 16,64] [--ns 1,4,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scale import LINEAR  # noqa: E402
from serving import build_model, make_variants, patch  # noqa: E402


@torch.inference_mode()
def decode(model, ids: torch.Tensor, steps: int, **kw) -> tuple[float, torch.Tensor]:
    """(seconds for `steps` greedy tokens after the prefill, tokens (B, steps + 1)), synchronised; `kw` go to
    every forward (PEFT's adapter_names)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    out = model(input_ids=ids, use_cache=True, **kw)
    nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
    toks, past = [nxt], out.past_key_values
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True, **kw)
        past = out.past_key_values
        nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
        toks.append(nxt)
    sync()
    return time.perf_counter() - t0, torch.cat(toks, 1).cpu()


def to_device(variants: list[dict], device: str) -> list[dict]:
    """Each variant's (signs, log8 codes, ref) on `device`."""
    return [{n: (sg.to(device), c.to(device), ref) for n, (sg, c, ref) in v.items()} for v in variants]


def tokens_per_s(model, ids: torch.Tensor, steps: int, repeats: int) -> tuple[float, torch.Tensor]:
    """(fastest of `repeats` decodes in tokens per second, that run's tokens), after a warm-up."""
    decode(model, ids, 2)  # the first call compiles the Triton kernel for these shapes
    runs = [decode(model, ids, steps) for _ in range(repeats)]
    return ids.shape[0] * steps / min(r[0] for r in runs), runs[0][1]


def bound(n: int) -> float:
    """The memory bound of a batch with n distinct 1-bit variants over a bf16 base: 2 / (2 + n / 8)."""
    return 16 / (16 + n)


def lora_batch(size: str, device: str, ids: torch.Tensor, *, adapters: int, rank: int, steps: int,
               repeats: int) -> dict:
    """PEFT's mixed-adapter decode: `adapters` LoRA adapters of rank `rank` on every decoder Linear, row i using
    adapter i mod `adapters`, against the same base alone (both measured here)."""
    from peft import LoraConfig, get_peft_model

    model = build_model(size).to(device)
    base_tps, _ = tokens_per_s(model, ids, steps, repeats)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LINEAR), lora_dropout=0.0, init_lora_weights=False)
    pm = get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, adapters):
        pm.add_adapter(f"a{i}", cfg)
    pm.eval()
    names = [f"a{i % adapters}" for i in range(ids.shape[0])]
    decode_kw = {"adapter_names": names}
    decode(pm, ids, 2, **decode_kw)
    runs = [decode(pm, ids, steps, **decode_kw) for _ in range(repeats)]
    tps = ids.shape[0] * steps / min(r[0] for r in runs)
    del pm, model
    return {"adapters": adapters, "rank": rank, "batch": ids.shape[0], "tokens_per_s": tps,
            "base_alone_tokens_per_s": base_tps, "vs_base": tps / base_tps}


def sweep(model, variants: list[dict], state: dict, ids: torch.Tensor, ns: list[int], steps: int,
          repeats: int) -> dict:
    """One batch: the base alone, then each n <= batch with rows served by n distinct variants."""
    batch = ids.shape[0]
    state["rows"] = None
    base_tps, base_toks = tokens_per_s(model, ids, steps, repeats)
    out = {"batch": batch, "base_alone_tokens_per_s": base_tps, "variants": {}}
    for n in (n for n in ns if n <= batch):
        state["variants"], state["rows"] = variants[:n], torch.arange(batch) % n
        tps, toks = tokens_per_s(model, ids, steps, repeats)
        share = tps / base_tps
        out["variants"][str(n)] = {"tokens_per_s": tps, "vs_base": share, "bound": bound(n),
                                   "bound_share": share / bound(n),
                                   "tokens_differ_from_base": bool((toks != base_toks).any())}
        print(json.dumps({"batch": batch, "n": n, **out["variants"][str(n)]}), flush=True)
    state["rows"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--batches", default="16,64", help="batch sizes, comma-separated")
    ap.add_argument("--ns", default="1,4,16,64", help="distinct variants in a batch, comma-separated")
    ap.add_argument("--codec-variants", type=int, default=2, help="variants encoded by the codec; the rest reuse "
                    "their scales with fresh random signs (benchmarks/serving.py)")
    ap.add_argument("--lora-adapters", type=int, default=16, help="PEFT adapters in the LoRA batch; 0 = none")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches, ns = [int(b) for b in a.batches.split(",")], [int(n) for n in a.ns.split(",")]
    model = build_model(a.size)
    t = time.perf_counter()
    most = max(n for n in ns if n <= max(batches))
    variants, _ = make_variants(model, most, codec_variants=min(most, a.codec_variants))
    build_s = time.perf_counter() - t
    model, variants = model.to(a.device), to_device(variants, a.device)
    res = {"size": a.size, "decode_steps": a.steps, "prompt_tokens": a.prompt, "repeats": a.repeats,
           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "variant_build_seconds": build_s, "batches": []}
    state = {"rows": None, "variants": []}
    patch(model, state)
    gen = torch.Generator().manual_seed(5)
    for b in batches:
        ids = torch.randint(0, model.config.vocab_size, (b, a.prompt), generator=gen).to(a.device)
        res["batches"].append(sweep(model, variants, state, ids, ns, a.steps, a.repeats))
    vocab = model.config.vocab_size
    del model, variants, state
    if a.lora_adapters:
        ids = torch.randint(0, vocab, (16, a.prompt), generator=gen).to(a.device)
        res["lora"] = lora_batch(a.size, a.device, ids, adapters=a.lora_adapters, rank=a.lora_rank,
                                 steps=a.steps, repeats=a.repeats)
        print(json.dumps({"lora": res["lora"]}), flush=True)
    if a.device == "cuda":
        res["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    res["targets"] = targets(res)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


def targets(res: dict) -> dict:
    """Issue 53's: bound_share >= 0.9 for n = 4, 16, 64 (the lowest over the batches that hold n), PEFT's 16
    adapters >= 0.8x the base."""
    share = {n: min((b["variants"][n]["bound_share"] for b in res["batches"] if n in b["variants"]), default=None)
             for n in ("4", "16", "64")}
    lora = res.get("lora", {}).get("vs_base") if res.get("lora", {}).get("adapters") == 16 else None
    met = all(v is not None and v >= 0.9 for v in share.values()) and lora is not None and lora >= 0.8
    return {"bound_share": share, "lora_16_over_base": lora, "met": met}


if __name__ == "__main__":
    main()
