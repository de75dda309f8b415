"""Codec benchmark: compression ratio, relative L2 error and speed relative to ``tensor.clone()``.

Run ``python benchmarks/codec.py`` (or ``--quick``); prints one JSON document. Sections:

* ``matrix``: one (4096, 4096) fp32 Gaussian delta (1024x1024 with --quick), every codec/setting.
* ``model``: a synthetic delta with the shapes of a Qwen3-like state dict (built from a transformers
  ``Qwen3Config`` on the meta device; no downloads), every codec.
* ``lora_rank8``: rank-8 LoRA factors on every Linear of that model (and of the 1.8M tiny model):
  factors in fp16 vs a sign code of the merged delta, size and relative L2 error, and auto's choices.

Rows ``*_log8`` store one float32 reference per tensor and one byte per group (``scale_dtype="log8"``);
``rel_l2_error_vs_f32_scales`` is their error relative to the same grouping with float32 scales, minus 1.
``--out PATH`` also writes the JSON to PATH (the committed full run is ``benchmarks/results/codec.json``).

Times are the minimum over repeats; each codec's time is divided by the clone time of the same input
measured in the same run (clone and codec interleaved), so the ratios survive a busy machine better
than absolute seconds. Targets (issue 2): bitdelta >= 30x smaller than fp32 and >= 15x than bf16 with
per-row or group >= 128 scales; encode and decode each within 2x of clone.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch

from zoo_gym.codec import LoraFactors, decode, decode_tensor, encode, read_manifest


def _min_time(fn, *, repeats: int, clone_fn) -> tuple[float, float, object]:
    """(best codec seconds, best clone seconds, last result), interleaving the two."""
    best, best_clone, out = math.inf, math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        clone = clone_fn()
        t1 = time.perf_counter()
        del clone
        out = None
        t2 = time.perf_counter()
        out = fn()
        t3 = time.perf_counter()
        best_clone, best = min(best_clone, t1 - t0), min(best, t3 - t2)
    return best, best_clone, out


def _global_rel_error(out: dict, ref: dict) -> float:
    num = sum(float(((out[k].double() - _dense(v).double()) ** 2).sum()) for k, v in ref.items())
    den = sum(float((_dense(v).double() ** 2).sum()) for v in ref.values())
    return math.sqrt(num / den)


def _dense(v):
    return v.merged() if isinstance(v, LoraFactors) else v


def _measure(delta: dict, settings: dict, *, repeats: int) -> dict:
    numel = sum(_dense(v).numel() for v in delta.values())

    def clone_all():
        return {k: (v.A.clone(), v.B.clone()) if isinstance(v, LoraFactors) else v.clone() for k, v in delta.items()}

    one = len(delta) == 1
    name0 = next(iter(delta))
    enc_t, enc_clone, payload = _min_time(lambda: encode(delta, **settings), repeats=repeats, clone_fn=clone_all)
    dec_fn = (lambda: {name0: decode_tensor(payload, name0)}) if one else (lambda: decode(payload))
    dec_t, dec_clone, out = _min_time(dec_fn, repeats=repeats, clone_fn=clone_all)
    codecs: dict[str, int] = {}
    for e in read_manifest(payload).entries:
        codecs[e.codec] = codecs.get(e.codec, 0) + 1
    size = len(payload)
    return {
        "settings": {k: v for k, v in settings.items()},
        "bytes": size,
        "bits_per_param": round(8 * size / numel, 4),
        "ratio_vs_fp32": round(4 * numel / size, 2),
        "ratio_vs_bf16": round(2 * numel / size, 2),
        "rel_l2_error": round(_global_rel_error(out, delta), 5),
        "encode_s": round(enc_t, 5),
        "decode_s": round(dec_t, 5),
        "clone_s": round(min(enc_clone, dec_clone), 5),
        "encode_vs_clone": round(enc_t / enc_clone, 3),
        "decode_vs_clone": round(dec_t / dec_clone, 3),
        "codecs_chosen": codecs,
    }


MATRIX_SETTINGS = {
    "bitdelta_per_row": dict(codec="bitdelta", group_size=None),
    "bitdelta_per_tensor": dict(codec="bitdelta", group_size=-1),
    "bitdelta_g128_f32": dict(codec="bitdelta", group_size=128, scale_dtype="float32"),
    "bitdelta_g128_bf16": dict(codec="bitdelta", group_size=128, scale_dtype="bfloat16"),
    "bitdelta_g128_log8": dict(codec="bitdelta", group_size=128, scale_dtype="log8"),
    "bitdelta_g64_f32": dict(codec="bitdelta", group_size=64, scale_dtype="float32"),
    "bitdelta_g64_log8": dict(codec="bitdelta", group_size=64, scale_dtype="log8"),
    "bitdelta_g32_f32": dict(codec="bitdelta", group_size=32, scale_dtype="float32"),
    "bitdelta_g32_log8": dict(codec="bitdelta", group_size=32, scale_dtype="log8"),
    "bitdelta_g256_bf16": dict(codec="bitdelta", group_size=256, scale_dtype="bfloat16"),
    "bitdelta_g512_f32": dict(codec="bitdelta", group_size=512, scale_dtype="float32"),
    "int4_g128": dict(codec="int4", group_size=128),
    "int8_g128": dict(codec="int8", group_size=128),
    "fp16": dict(codec="fp16"),
    "bf16": dict(codec="bf16"),
}
MODEL_SETTINGS = {
    "bitdelta_per_row": dict(codec="bitdelta", group_size=None),
    "bitdelta_g128_f32": dict(codec="bitdelta", group_size=128, scale_dtype="float32"),
    "bitdelta_g128_log8": dict(codec="bitdelta", group_size=128, scale_dtype="log8"),
    "bitdelta_g64_log8": dict(codec="bitdelta", group_size=64, scale_dtype="log8"),
    "bitdelta_g32_f32": dict(codec="bitdelta", group_size=32, scale_dtype="float32"),
    "bitdelta_g32_log8": dict(codec="bitdelta", group_size=32, scale_dtype="log8"),
    "bitdelta_g256_bf16": dict(codec="bitdelta", group_size=256, scale_dtype="bfloat16"),
    "int4_g128": dict(codec="int4", group_size=128),
    "int8_g128": dict(codec="int8", group_size=128),
    "fp16": dict(codec="fp16"),
    "auto_default": dict(codec="auto"),
}


def _log8_vs_f32(results: dict) -> None:
    """Add ``rel_l2_error_vs_f32_scales`` (log8 error / float32-scale error - 1) to each log8 row."""
    for name, r in results.items():
        if name.endswith("_log8") and name[: -len("log8")] + "f32" in results:
            base = results[name[: -len("log8")] + "f32"]["rel_l2_error"]
            r["rel_l2_error_vs_f32_scales"] = round(r["rel_l2_error"] / base - 1, 6)


def _target(name: str, r: dict) -> dict | None:
    if not name.startswith("bitdelta"):
        return None
    return {
        ">=30x_vs_fp32": r["ratio_vs_fp32"] >= 30,
        ">=15x_vs_bf16": r["ratio_vs_bf16"] >= 15,
        "encode<=2x_clone": r["encode_vs_clone"] <= 2,
        "decode<=2x_clone": r["decode_vs_clone"] <= 2,
    }


def _qwen3_shapes(*, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> dict[str, tuple]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                      tie_word_embeddings=True, max_position_embeddings=512)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _model_delta(shapes: dict, *, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()}


def _lora_delta(shapes: dict, *, seed: int, rank: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, s in shapes.items():
        if len(s) == 2 and ".layers." in k:  # the Linear weights LoRA adapts ("all-linear" minus embeddings)
            a = torch.randn(rank, s[1], generator=g) / math.sqrt(s[1])  # (r, in), kaiming-like
            b = torch.randn(s[0], rank, generator=g) * 1e-2 * 2.0  # (out, r), trained B times alpha/r = 2
            out[k] = LoraFactors(A=a, B=b)
    return out


def _lora_section(shapes: dict, *, repeats: int) -> dict:
    delta = _lora_delta(shapes, seed=1)
    merged = {k: v.merged() for k, v in delta.items()}
    numel = sum(v.numel() for v in merged.values())
    res = {"n_matrices": len(delta), "merged_params": numel}
    for name, (d, kw) in {
        "lora_factors_fp16": (delta, dict(codec="lora", lora_codec="fp16")),
        "bitdelta_merged_per_tensor": (merged, dict(codec="bitdelta", group_size=-1)),
        "bitdelta_merged_per_row": (merged, dict(codec="bitdelta", group_size=None)),
        "bitdelta_merged_g128": (merged, dict(codec="bitdelta", group_size=128)),
        "auto_default": (delta, dict(codec="auto")),
    }.items():
        r = _measure(d, kw, repeats=repeats)
        res[name] = {k: r[k] for k in ("bytes", "ratio_vs_fp32", "rel_l2_error", "codecs_chosen")}
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs and fewer repeats (CI smoke run)")
    ap.add_argument("--out", default=None, help="also write the JSON to this file (e.g. benchmarks/results/codec.json)")
    args = ap.parse_args(argv)
    n = 1024 if args.quick else 4096
    repeats = 3 if args.quick else 7
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=g) * 1e-3
    report: dict = {
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
                "quick": args.quick},
        "matrix": {"shape": [n, n], "dtype": "float32", "results": {}},
    }
    for name, kw in MATRIX_SETTINGS.items():
        r = _measure({"x": x}, kw, repeats=repeats)
        t = _target(name, r)
        if t is not None:
            r["targets"] = t
        report["matrix"]["results"][name] = r
    _log8_vs_f32(report["matrix"]["results"])
    del x
    big = dict(hidden=512, inter=1536, layers=8, heads=8, kv=4, vocab=32000)
    small = dict(hidden=256, inter=768, layers=2, heads=4, kv=2, vocab=8000)
    shapes = _qwen3_shapes(**(small if args.quick else big))
    delta = _model_delta(shapes, seed=2)
    report["model"] = {
        "config": small if args.quick else big,
        "n_tensors": len(shapes),
        "params": sum(math.prod(s) for s in shapes.values()),
        "results": {},
    }
    for name, kw in MODEL_SETTINGS.items():
        report["model"]["results"][name] = _measure(delta, kw, repeats=max(1, repeats // 2))
    _log8_vs_f32(report["model"]["results"])
    del delta
    report["lora_rank8"] = {
        "model": _lora_section(shapes, repeats=1),
        "tiny_model_1.8M": _lora_section(_qwen3_shapes(hidden=192, inter=512, layers=4, heads=4, kv=2, vocab=300),
                                         repeats=1),
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return report


if __name__ == "__main__":
    main()
