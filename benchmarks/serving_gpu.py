"""Serving 16 BitDelta variants on a CUDA GPU (issue 32): decode tokens per second of a batch of 16 requests,
each with its own variant, against the base alone, same batch, same run.

Model and variants as benchmarks/serving.py (a bf16 Qwen3 of `--size`'s dimensions, random weights; 16
variants of every decoder Linear, bitdelta groups of 128), moved to the GPU; each Linear patched with
serving.py's BitDeltaLinear (zoo_gym.serving.kernels.bitdelta_linear, Triton on CUDA). Two variant forms:
log8 scale codes (as gym-serve holds them) and the same scales decoded to float32 once. Timing: CUDA
synchronised wall time of `--steps` greedy decode steps after the prefill, fastest of `--repeats`.
`--device cpu` runs the same on the CPU path (a smoke test of the script, not a GPU figure).

    python benchmarks/serving_gpu.py [--size 0.6b|tiny] [--steps 32] [--device cuda|cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serving import BATCH, build_model, make_variants, patch  # noqa: E402

from zoo_gym.codec.logscale import LOG8_MULT  # noqa: E402


@torch.inference_mode()
def decode(model, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """(seconds for `steps` greedy tokens after the prefill, tokens (B, steps + 1)), synchronised."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
    toks, past = [nxt], out.past_key_values
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
        toks.append(nxt)
    sync()
    return time.perf_counter() - t0, torch.cat(toks, 1).cpu()


def to_device(variants: list[dict], device: str, *, float_scales: bool) -> list[dict]:
    """Each (signs, log8 codes, ref) on `device`; with float_scales, (signs, float32 scales, None)."""
    table = torch.from_numpy(LOG8_MULT)
    out = []
    for v in variants:
        if float_scales:
            out.append({n: (s.to(device), (ref * table[c.long()]).to(device), None) for n, (s, c, ref) in v.items()})
        else:
            out.append({n: (s.to(device), c.to(device), ref) for n, (s, c, ref) in v.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--variants", type=int, default=16)
    ap.add_argument("--codec-variants", type=int, default=2, help="variants encoded by the codec; the rest reuse "
                    "their scales with fresh random signs (benchmarks/serving.py)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = build_model(a.size)
    t = time.perf_counter()
    variants, _ = make_variants(model, a.variants, codec_variants=min(a.variants, a.codec_variants))
    build_s = time.perf_counter() - t
    model = model.to(a.device)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, a.prompt), generator=torch.Generator().manual_seed(5))
    ids = ids.to(a.device)
    res = {"size": a.size, "batch": BATCH, "variants": a.variants, "prompt_tokens": a.prompt, "decode_steps": a.steps,
           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__, "variant_build_seconds": build_s}
    decode(model, ids, 2)  # warm-up
    base_runs = [decode(model, ids, a.steps) for _ in range(a.repeats)]
    base_tps = BATCH * a.steps / min(r[0] for r in base_runs)
    res["base_alone_tokens_per_s"] = base_tps
    state = {"rows": None, "variants": []}
    patch(model, state)
    for form, float_scales in (("log8_codes", False), ("float32_scales", True)):
        state["variants"] = to_device(variants, a.device, float_scales=float_scales)
        state["rows"] = torch.arange(BATCH) % a.variants
        decode(model, ids, 2)  # compiles the Triton kernel on the first call
        runs = [decode(model, ids, a.steps) for _ in range(a.repeats)]
        tps = BATCH * a.steps / min(r[0] for r in runs)
        res[f"bitdelta_{form}"] = {"tokens_per_s": tps, "vs_base": tps / base_tps,
                                   "tokens_differ_from_base": bool((runs[0][1] != base_runs[0][1]).any())}
        print(json.dumps({form: res[f"bitdelta_{form}"]}), flush=True)
        state["rows"] = None
    res["target_vs_base_ge_0.8"] = bool(res["bitdelta_log8_codes"]["vs_base"] >= 0.8)
    if a.device == "cuda":
        res["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
