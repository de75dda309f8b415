"""Serving many BitDelta variants over one base (issue 17 item 4): memory per variant, mixed-batch decode
throughput against three baselines measured in the same run, time to first token, peak RSS.

Model: a bf16 Qwen3 with the tiny model's or Qwen3-0.6B's dimensions (benchmarks/scale.py's SIZES),
random weights, built in memory. Variants: random deltas (RMS 0.01) of every decoder Linear weight
(q/k/v/o/gate/up/down), encoded with zoo_gym.codec (bitdelta, groups of 128, log8 scales) and held as
packed signs (uint8) + the codec's log8 scale codes (1 byte per group, one float32 reference per
tensor; `bitdelta_linear(scale_refs=)`). `--codec-variants K` (default: all; the
0.6B run used 4) are encoded with the codec; past K, a variant is fresh random sign bytes with the
scales of variant i mod K (encoding 100 random 0.6B deltas takes ~10 min; the bytes are the same).

Each linear is patched here with a small module calling `zoo_gym.serving.kernels.bitdelta_linear` with
the batch's variant of each row. Decode: a batch of 16 requests (prompt of `--prompt` random tokens,
then `--steps` greedy tokens with the KV cache), request i using variant i mod N. Baselines, same
batch, same run:
  (a) base alone: the same batch through the unpatched base (the ceiling);
  (b) merge-swap: requests one after another, each served by the base with its decoded delta merged
      into the weights (copy base weights, add delta; batch 1); `--swap-requests` of the 16 are run
      and the throughput is over those;
  (c) PEFT LoRA: the same 16 requests with 16 LoRA adapters in one batch through PEFT's mixed-adapter
      inference (`adapter_names=`), at rank 16 and at the rank whose bf16 bytes equal a variant's.
Time to first token: the prefill's wall time (batched methods); for merge-swap the mean over requests
of the time until each one's first token when served in turn.
Peak RSS: a child process loads the base and warms the kernels for float32 and bf16 inputs (their
compiled code is part of the process serving the base), runs a base-only batch twice (the second one's
peak = "base"), adds N variants (each held in one buffer, as read from a file) and runs the mixed batch
(peaks reset before each batch, after releasing the variants' build temporaries); reported against
base + N x variant bytes x 1.2, beside the base-only batch's peak with the variants loaded.
Throughput is the fastest of `--repeats` runs, per wall second and per CPU second of the process, with
the same --threads for every method. The headline ratio is per CPU second (`vs_base_cpu`): the
development machine is shared, and another process's load stretches wall time but not this one's CPU
seconds; with --threads 1 under the benchmark lock the two agree.

    python benchmarks/serving.py [--size tiny|0.6b] [--variants 1,16,100] [--steps 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from scale import LINEAR, SIZES  # noqa: E402

from zoo_gym import codec  # noqa: E402
from zoo_gym.codec.bitdelta import unpack_bitdelta  # noqa: E402
from zoo_gym.codec.layout import Groups  # noqa: E402
from zoo_gym.codec.logscale import log8_scales  # noqa: E402
from zoo_gym.serving.kernels import bitdelta_linear, log8_scale_codes, warm_up  # noqa: E402

BATCH = 16
GROUP = 128


def build_model(size: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def linears(model) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in LINEAR}


def make_variants(model, n: int, *, codec_variants: int, seed: int = 1):
    """n variants {linear name: (signs uint8, log8 scale codes uint8, reference)} and one's payload bytes."""
    lin = linears(model)
    out, disk = [], []
    for i in range(n):
        v, nbytes = {}, 0
        g = torch.Generator().manual_seed(seed + i)
        for name, m in lin.items():
            if i < codec_variants:
                d = torch.randn(m.weight.shape, generator=g) * 0.01
                payload = codec.encode({"w": d}, codec="bitdelta", group_size=GROUP, scale_dtype="log8")
                p = codec.read_bitdelta(payload, "w")
                v[name] = (p.signs.clone(), *log8_scale_codes(p.scales))
                nbytes += len(payload)
            else:
                s0, c0, r0 = out[i % codec_variants][name]
                v[name] = (torch.randint(0, 256, s0.shape, dtype=torch.uint8, generator=g), c0.clone(), r0)
        out.append(_one_buffer(v))
        disk.append(nbytes)
    return out, (disk[0] if disk else 0)


def _one_buffer(v: dict) -> dict:
    """The variant's sign bytes and scale codes moved into one uint8 buffer (views into it), as a server
    reading a variant file holds them: one allocation instead of two per tensor (at the tiny size, the
    allocator's and tensors' per-allocation overhead was half a variant's bytes)."""
    parts = [t for s, c, _ in v.values() for t in (s, c)]
    flat = torch.empty(sum(t.numel() for t in parts), dtype=torch.uint8)
    views, at = [], 0
    for t in parts:
        views.append(flat[at:at + t.numel()].view(t.shape))
        views[-1].copy_(t)
        at += t.numel()
    return {name: (views[2 * k], views[2 * k + 1], ref) for k, (name, (_, _, ref)) in enumerate(v.items())}


def variant_bytes(v: dict) -> int:
    """Resident bytes of one variant: sign bytes, one log8 code per group, one float32 reference per tensor."""
    return sum(s.numel() + c.numel() + 4 for s, c, _ in v.values())


class BitDeltaLinear(nn.Module):
    """A base Linear plus each batch row's variant delta (packed) through bitdelta_linear."""

    def __init__(self, base: nn.Linear, name: str, state: dict) -> None:
        super().__init__()
        self.base, self.name, self.state = base, name, state

    def forward(self, x):
        st = self.state
        if st["rows"] is None:
            return self.base(x)
        packs = [v[self.name] for v in st["variants"]]
        return bitdelta_linear(x, self.base.weight, self.base.bias, [p[0] for p in packs], [p[1] for p in packs],
                               GROUP, st["rows"], scale_refs=[p[2] for p in packs])


def patch(model, state: dict) -> None:
    for name, m in linears(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, BitDeltaLinear(m, name, state))


@torch.inference_mode()
def decode(model, ids: torch.Tensor, steps: int, **kw) -> tuple[float, float, torch.Tensor]:
    """Greedy: (prefill s, decode wall s for `steps` more tokens, tokens (B, steps + 1), decode CPU s)."""
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, **kw)
    nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
    t1, c1 = time.perf_counter(), time.process_time()
    toks, past = [nxt], out.past_key_values
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True, **kw)
        past = out.past_key_values
        nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
        toks.append(nxt)
    return t1 - t0, time.perf_counter() - t1, torch.cat(toks, 1), time.process_time() - c1


def rates(runs, steps: int) -> dict:
    """Fastest of the repeated runs: tokens per wall second, per CPU second of this process, prefill time."""
    return {"tokens_per_s": BATCH * steps / min(r[1] for r in runs),
            "tokens_per_cpu_s": BATCH * steps / min(r[3] for r in runs), "ttft_s": min(r[0] for r in runs)}


def merge_swap(model, variants, ids, steps: int, n_req: int) -> dict:
    """Requests in turn, each with its variant merged into the weights (base weights restored from a copy)."""
    lin = linears(model)
    saved = {n: m.weight.detach().clone() for n, m in lin.items()}
    t0 = time.perf_counter()
    ttft, swap_s = [], 0.0
    for r in range(n_req):
        v = variants[r % len(variants)]
        ts = time.perf_counter()
        with torch.no_grad():
            for n, m in lin.items():
                s, c, ref = v[n]
                rows, cols = m.weight.shape
                d = unpack_bitdelta(s.numpy(), log8_scales(np.float32(ref), c.numpy()), cols=cols,
                                    groups=Groups(size=GROUP, n_groups=c.shape[1], scale_rows=rows))
                m.weight.copy_(saved[n]).add_(torch.from_numpy(d).to(torch.bfloat16))
        sw = time.perf_counter() - ts
        swap_s += sw
        pre = decode(model, ids[r:r + 1], steps)[0]  # the request's whole generation at batch 1
        ttft.append(ts - t0 + sw + pre)
    total = time.perf_counter() - t0
    with torch.no_grad():
        for n, m in lin.items():
            m.weight.copy_(saved[n])
    return {"requests": n_req, "seconds": total, "tokens_per_s": n_req * steps / total,
            "swap_seconds_per_request": swap_s / n_req, "ttft_mean_s": float(np.mean(ttft))}


def peft_batch(size: str, rank: int, ids, steps: int, repeats: int) -> dict:
    from peft import LoraConfig, get_peft_model

    model = build_model(size)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LINEAR), lora_dropout=0.0, init_lora_weights=False)
    pm = get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, BATCH):
        pm.add_adapter(f"a{i}", cfg)
    pm.eval()
    names = [f"a{i}" for i in range(BATCH)]
    lora_bytes = sum(p.numel() * 2 for n, p in pm.named_parameters() if "lora_" in n and ".a0." in n)
    runs = [decode(pm, ids, steps, adapter_names=names) for _ in range(repeats)]
    del pm, model
    return {"rank": rank, "adapter_bytes": lora_bytes, **rates(runs, steps)}


def rss_child(size: str, n: int, codec_variants: int, prompt: int, steps: int) -> dict:
    """Peak RSS of a base-only batch, then of the mixed batch with n variants loaded (peaks reset before each
    batch; the variants' build temporaries are released first: a server reads them packed from disk)."""
    import ctypes

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def settle():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    model = build_model(size)
    warm_up()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, prompt), generator=torch.Generator().manual_seed(5))
    decode(model, ids, steps)
    settle()
    base_rss = status("VmRSS:")
    decode(model, ids, steps)
    base = status("VmHWM:")
    variants, _ = make_variants(model, n, codec_variants=min(n, codec_variants))
    vbytes = variant_bytes(variants[0])
    state = {"rows": None, "variants": variants[:BATCH]}
    patch(model, state)
    state["rows"] = torch.arange(BATCH) % min(n, BATCH)
    decode(model, ids, steps)
    settle()
    state["rows"] = None  # the base-only batch again, now beside the loaded variants (heap layout moved)
    decode(model, ids, steps)
    base_loaded = status("VmHWM:")
    state["rows"] = torch.arange(BATCH) % min(n, BATCH)
    settle()
    loaded = status("VmRSS:")
    decode(model, ids, steps)
    peak = status("VmHWM:")
    limit = base + 1.2 * n * vbytes
    return {"variants": n, "base_rss": base_rss, "base_peak_rss": base, "variant_bytes": vbytes,
            "rss_with_variants_loaded": loaded,
            "base_batch_peak_rss_with_variants_loaded": base_loaded, "peak_rss": peak,
            "limit_base_plus_1.2x_variants": int(limit), "within": peak <= limit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--variants", default="1,16,100")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="decode runs per method; the fastest is reported")
    ap.add_argument("--swap-requests", type=int, default=BATCH)
    ap.add_argument("--codec-variants", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch and kernel threads (1: CPU seconds are comparable)")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.rss_child:
        print(json.dumps(rss_child(a.size, a.rss_child, a.codec_variants, a.prompt, min(a.steps, 4))))
        return
    ns = [int(s) for s in a.variants.split(",")]
    model = build_model(a.size)
    lin = linears(model)
    warm_up()
    n_lin = sum(m.weight.numel() for m in lin.values())
    n_all = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (BATCH, a.prompt), generator=torch.Generator().manual_seed(5))
    res: dict = {"size": a.size, "params": n_all, "adapted_linear_params": n_lin, "batch": BATCH,
                 "prompt_tokens": a.prompt, "decode_steps": a.steps, "threads": a.threads,
                 "machine": f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                 "torch": torch.__version__, "device": "cpu",
                 "headline": "vs_base_cpu: tokens per CPU second of the process against the base alone's, same threads"}

    runs = [decode(model, ids, a.steps) for _ in range(a.repeats)]
    base = rates(runs, a.steps)
    base_tokens = runs[0][2]
    res["base_alone"] = base

    t = time.perf_counter()
    variants, disk_bytes = make_variants(model, max(ns), codec_variants=min(max(ns), a.codec_variants))
    res["variant_build_seconds"] = time.perf_counter() - t
    mem_bytes = variant_bytes(variants[0])
    f32_bytes = sum(s.numel() + c.numel() * 4 for s, c, _ in variants[0].values())
    lora16 = sum(16 * (m.in_features + m.out_features) * 2 for m in lin.values())
    res["memory_per_variant"] = {
        "bitdelta_in_memory_bytes": mem_bytes, "bitdelta_payload_bytes_log8": disk_bytes,
        "bitdelta_in_memory_bytes_float32_scales": f32_bytes,
        "bf16_copy_of_adapted_linears_bytes": n_lin * 2, "bf16_copy_of_model_bytes": n_all * 2,
        "lora_r16_bf16_bytes": lora16,
        "bf16_linears_over_payload": n_lin * 2 / disk_bytes, "bf16_linears_over_in_memory": n_lin * 2 / mem_bytes,
        "bf16_linears_over_in_memory_float32_scales": n_lin * 2 / f32_bytes,
        "target_in_memory_le_1_15_of_bf16": mem_bytes * 15 <= n_lin * 2,
        "equal_memory_lora_rank": round(16 * mem_bytes / lora16)}

    merge_ids = ids
    swap = merge_swap(model, variants[:BATCH], merge_ids, a.steps, a.swap_requests)
    res["merge_swap"] = swap

    state = {"rows": None, "variants": []}
    patch(model, state)
    res["bitdelta"] = []
    for n in ns:
        state["variants"] = variants[:min(n, BATCH)] if n <= BATCH else variants[n - BATCH:n]
        state["rows"] = torch.arange(BATCH) % min(n, BATCH)
        runs = [decode(model, ids, a.steps) for _ in range(a.repeats)]
        state["rows"] = None
        row = {"variants_loaded": n, "distinct_in_batch": min(n, BATCH), **rates(runs, a.steps),
               "tokens_differ_from_base": bool((runs[0][2] != base_tokens).any())}
        row["vs_base"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["vs_base_cpu"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        row["vs_merge_swap"] = row["tokens_per_s"] / swap["tokens_per_s"]
        res["bitdelta"].append(row)
        print(json.dumps(row), flush=True)
    del variants, model, state
    gc.collect()

    if not a.skip_peft:
        res["peft"] = [peft_batch(a.size, r, ids, a.steps, a.repeats)
                       for r in sorted({16, res["memory_per_variant"]["equal_memory_lora_rank"]})]
        for row in res["bitdelta"]:
            row["vs_peft"] = {p["rank"]: row["tokens_per_s"] / p["tokens_per_s"] for p in res["peft"]}
            row["vs_peft_cpu"] = {p["rank"]: row["tokens_per_cpu_s"] / p["tokens_per_cpu_s"] for p in res["peft"]}

    res["peak_rss"] = []
    for n in ns:
        cmd = [sys.executable, __file__, "--size", a.size, "--rss-child", str(n), "--codec-variants",
               str(a.codec_variants), "--threads", str(a.threads), "--prompt", str(a.prompt)]
        res["peak_rss"].append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True)
                                          .stdout.strip().splitlines()[-1]))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
