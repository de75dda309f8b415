"""GGUF export checked by llama.cpp itself: greedy tokens of the tiny model through llama-cpp-python equal
transformers' (issue 30 item 4). Not in CI: llama-cpp-python builds from source for many minutes.

Run: python benchmarks/gguf_llama_cpp.py [--out benchmarks/gguf_llama_cpp.json]; skips (exit 0, a note)
when llama_cpp is not importable. Prompt token ids go in directly (no llama.cpp tokenization).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).with_suffix(".json"))
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable (pip install llama-cpp-python): nothing checked")
        return 0
    import torch
    from transformers import AutoModelForCausalLM

    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.proto.gguf_export import write_gguf

    prompt = [1, 45, 67, 89, 12, 34, 56, 2]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, do_sample=False, min_new_tokens=args.tokens,
                         )[0, len(prompt):].tolist()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for q in ("f16", "bf16", "q8_0"):
            path = write_gguf(tiny_model_dir(), pathlib.Path(tmp) / f"tiny-{q}.gguf", quantization=q, name="tiny")
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, verbose=False, logits_all=False)
            llm.eval(prompt)
            got = []
            for _ in range(args.tokens):
                tok = int(llm.sample(temp=0.0))
                got.append(tok)
                llm.eval([tok])
            results[q] = {"tokens": got, "equal": got == ref,
                          "agree_prefix": next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))}
    doc = {"llama_cpp": llama_cpp.__version__, "reference": ref, "results": results}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
