"""GGUF export checked by llama.cpp itself (issue 30 item 4): for each quantization, the greedy tokens of
the tiny model through llama-cpp-python equal transformers' on built-in task prompts, and the largest
logit gap over the prompt positions is reported. The other supported families (Llama, Gemma, GPT-2, as
random-init small models with the tiny tokenizer) are checked the same way and reported.

Not in CI: llama-cpp-python has no binary wheel on PyPI and builds llama.cpp from source (about 25 min
on this 2-core machine). Build it once, then run this:

    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF \
      -DLLAMA_CURL=OFF" pip wheel --no-deps -w wheels llama-cpp-python
    pip install --no-deps wheels/llama_cpp_python-*.whl diskcache
    python benchmarks/gguf_llama_cpp.py          # writes benchmarks/results/gguf_llama_cpp.json

Greedy on both sides is the plain argmax, ending at the end-of-turn token or after ``--tokens``; prompt
ids go in directly (the tokenizer's chat template, no llama.cpp tokenization). Exits 1 when the
tiny model's f16/bf16 tokens differ or its q8_0 first tokens do (8-bit weights may flip a near tie later
on), or when llama.cpp cannot load a file; a random-init family's near ties are only reported.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

RESULTS = pathlib.Path(__file__).parent / "results" / "gguf_llama_cpp.json"


def llama_greedy(llm, prompt: list[int], n: int, eos: int):
    """(greedy new tokens, ending at `eos` or after `n`; llama.cpp's logits at the prompt's positions)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    first = np.array(llm.scores[:len(prompt)], dtype=np.float64)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if tok == eos:
            break
        llm.eval([tok])
    return out, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    ap.add_argument("--tokens", type=int, default=16, help="most new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=8, help="built-in validation prompts")
    ap.add_argument("--families", default="tiny,llama,gemma,gpt2",
                    help="tiny (the shipped Qwen3) and random-init families to check")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable (pip install llama-cpp-python, see --help): nothing checked")
        return 0
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.gym_train import default_validation_examples, tiny_model_dir
    from zoo_gym.evaluation.chat import render_prompt_with
    from zoo_gym.proto.gguf_export import write_gguf

    from zoo_gym.gym_train.families import make_random_base

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    prompts = [tok(render_prompt_with(tok, ex), add_special_tokens=False)["input_ids"]
               for ex in default_validation_examples(n=args.prompts)]
    results, refs_by_family, ok = {}, {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model_dir = (tiny_model_dir() if family == "tiny"
                         else make_random_base(family, pathlib.Path(tmp) / family))
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            eos = tok.convert_tokens_to_ids("<|im_end|>")
            refs, ref_logits = [], []
            with torch.no_grad():
                for p in prompts:
                    refs.append(model.generate(torch.tensor([p]), max_new_tokens=args.tokens, do_sample=False,
                                               eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist())
                    ref_logits.append(model(torch.tensor([p])).logits[0].double().numpy())
            refs_by_family[family] = refs
            for q in ("f16", "bf16", "q8_0"):
                path = write_gguf(model_dir, pathlib.Path(tmp) / f"{family}-{q}.gguf", quantization=q, name=family)
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, logits_all=True)
                got, gaps = [], []
                for p, ref_l in zip(prompts, ref_logits):
                    seq, logits = llama_greedy(llm, p, args.tokens, eos)
                    got.append(seq)
                    gaps.append(float(np.abs(logits - ref_l).max()))
                llm.close()
                equal = [g == r for g, r in zip(got, refs)]
                results[f"{family}/{q}"] = {
                    "equal_prompts": sum(equal), "prompts": len(prompts), "all_equal": all(equal),
                    "first_token_equal": all(g[:1] == r[:1] for g, r in zip(got, refs)),
                    "max_logit_gap": max(gaps), "tokens": got}
                if family == "tiny":
                    r = results[f"{family}/{q}"]
                    ok &= r["all_equal"] if q != "q8_0" else r["first_token_equal"]
    doc = {"llama_cpp_python": llama_cpp.__version__,
           "models": "tiny: the shipped Qwen3 (4 layers, pretrained); others: random-init small models",
           "prompts": len(prompts), "max_new_tokens": args.tokens, "reference_tokens": refs_by_family,
           "results": results, "passed": ok}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "reference_tokens"} |
                     {"results": {q: {k: v for k, v in r.items() if k != "tokens"} for q, r in results.items()}},
                     indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
