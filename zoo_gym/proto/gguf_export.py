"""A Hugging Face checkpoint directory as one GGUF file for llama.cpp / Ollama (needs ``pip install gguf``).

``write_gguf(model_dir, path, quantization="f16"|"bf16"|"q8_0", name=...)`` writes what llama.cpp's
convert_hf_to_gguf.py writes for the families Zoo Gym trains (Qwen3, Llama, Gemma, GPT-2): its tensor
names (gguf's ``TensorNameMap``), hyperparameter keys, its per-family tensor edits (Llama's q/k rotary
permutation, Gemma's norm + 1, GPT-2's transposed Conv1D weights) and a gpt2-style BPE vocabulary
(``tokenizer.ggml.*`` from tokenizer.json plus gguf's ``SpecialVocab``: merges, special ids, chat template).
1-D tensors stay F32; q8_0 quantizes 2-D tensors whose rows are a multiple of 32 (others F16).
``general.name`` is the caller's public name: no filesystem path is written. The whole file is built in memory.
``write_gguf_dir`` writes BASE-zoo-gym-rROUND-QUANT.gguf and its model card into a directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QUANTIZATIONS = ("f16", "bf16", "q8_0")
_ARCH = {"qwen3": "QWEN3", "llama": "LLAMA", "gemma": "GEMMA", "gpt2": "GPT2"}


class GGUFExportError(ValueError):
    """The checkpoint cannot be written as GGUF; the message says why."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFExportError("GGUF export needs the gguf package: pip install 'zoo-gym[gguf]'") from None
    return gguf


def _hparams(writer, cfg: dict, family: str) -> None:
    """The {arch}.* keys convert_hf_to_gguf.py writes for `family`."""
    if family == "gpt2":
        writer.add_context_length(cfg["n_positions"])
        writer.add_embedding_length(cfg["n_embd"])
        writer.add_block_count(cfg["n_layer"])
        writer.add_feed_forward_length(cfg.get("n_inner") or 4 * cfg["n_embd"])
        writer.add_head_count(cfg["n_head"])
        writer.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    n_head = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or n_head)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if family == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if family in ("qwen3", "gemma") or cfg.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rotary layout -> llama.cpp's interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _edit(name: str, data: np.ndarray, cfg: dict, family: str) -> np.ndarray:
    """The per-family tensor edits of convert_hf_to_gguf.py (HF name, float32 data)."""
    if family == "llama" and name.endswith("q_proj.weight"):
        return _permute(data, cfg["num_attention_heads"])
    if family == "llama" and name.endswith("k_proj.weight"):
        return _permute(data, cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if family == "gemma" and name.endswith("norm.weight"):
        return data + 1
    if family == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return np.ascontiguousarray(data.T)
    return data


def _encode(gguf, data: np.ndarray, name: str, quantization: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor: 1-D and norms F32, others as asked (q8_0 where rows fit)."""
    q = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return data.astype(np.float32), None
    if quantization == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0] == 0:
        return gguf.quants.quantize(data, q.Q8_0), q.Q8_0
    if quantization == "bf16":
        return gguf.quants.quantize(data, q.BF16), q.BF16
    return data.astype(np.float16), None


def tensors(model_dir: Path, family: str, cfg: dict):
    """(gguf name, HF name, edited float32 array) for each weight of the checkpoint, in file order."""
    gguf = _gguf()
    from safetensors import safe_open

    n_blocks = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCH[family]), n_blocks)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.endswith((".attn.bias", ".attn.masked_bias")) or (family == "gemma" and key == "lm_head.weight"):
                    continue
                new = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise GGUFExportError(f"tensor {key!r} has no llama.cpp name for {family}")
                data = st.get_tensor(key).float().numpy()
                yield new, key, _edit(key, data, cfg, family)


def _vocab(gguf, writer, model_dir: Path, n_vocab: int) -> None:
    """A gpt2-style BPE vocabulary as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if (tok.get("model") or {}).get("type") != "BPE":
        raise GGUFExportError("GGUF export writes byte-level BPE vocabularies only (tokenizer.json model BPE)")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    kinds = {a["id"]: (gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
             for a in tok.get("added_tokens") or ()}
    by_id.update({a["id"]: a["content"] for a in tok.get("added_tokens") or ()})
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    types = [kinds.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED) for i in range(n_vocab)]
    digits = "individual_digits" in json.dumps(tok.get("pre_tokenizer"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if digits else "gpt-2")  # qwen2's regex splits digits one by one
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer)


def write_gguf(model_dir, path, *, quantization: str = "f16", name: str = "zoo-gym") -> Path:
    """Write the checkpoint in `model_dir` to the GGUF file `path`; return it."""
    gguf = _gguf()
    if quantization not in QUANTIZATIONS:
        raise GGUFExportError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    model_dir, path = Path(model_dir), Path(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    family = cfg.get("model_type")
    if family not in _ARCH:
        raise GGUFExportError(f"GGUF export supports {', '.join(_ARCH)} checkpoints, not {family!r}")
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, _ARCH[family])])
    writer.add_name(name)
    _hparams(writer, cfg, family)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantization])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _vocab(gguf, writer, model_dir, cfg["vocab_size"])
    for new, key, data in tensors(model_dir, family, cfg):
        array, raw = _encode(gguf, data, new, quantization)
        writer.add_tensor(new, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_dir(hf, out, rows: list[dict], *, base_model: str, quantization: str = "f16",
                   license: str = "unknown", weights: str | None = None) -> Path:
    """`out`/BASE-zoo-gym-rROUND-QUANT.gguf from the Hugging Face directory `hf`, and the README.md card
    (`rows`: the lineage rows, genesis first; `base_model`: a public name); return the file."""
    from zoo_gym.proto.model_card import write_model_card

    out = Path(out)
    name = f"{base_model.replace('/', '--')}-zoo-gym-r{rows[-1].get('round') if rows else 0}"
    out.mkdir(parents=True, exist_ok=True)
    path = write_gguf(hf, out / f"{name}-{quantization}.gguf", quantization=quantization, name=name)
    write_model_card(out, rows, base_model=base_model, license=license, gguf=path.name, weights=weights)
    return path
