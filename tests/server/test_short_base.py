"""`gym-server init` trains its preflight step on the base's first decoder layers (issue 29 item 2): the short
base loads without missing weights, holds the base's own tensors, and a client's LoRA step runs on it, for
families that name their layers differently (`model.layers.N.`, GPT-2's `h.N.`) and carry per-layer lists
(Gemma's `layer_types`)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from zoo_gym.gym_train import default_validation_examples
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.gym_train.preflight import check_trainable
from zoo_gym.server.short_base import short_base


def _deeper(base, layers: int = 4):
    cfg = AutoConfig.from_pretrained(base)
    cfg.num_hidden_layers = layers  # GPT-2 maps it to n_layer
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = (cfg.layer_types * layers)[:layers]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(base)
    return base


@pytest.mark.parametrize("family", ["qwen3", "gpt2", "gemma"])
def test_the_short_base_is_the_first_layers_of_the_base_and_trains(tmp_path, family):
    base = _deeper(make_random_base(family, tmp_path / "base"))
    short = short_base(base, tmp_path / "short", layers=2)

    assert AutoConfig.from_pretrained(short).get_text_config().num_hidden_layers == 2
    model, info = AutoModelForCausalLM.from_pretrained(short, output_loading_info=True)
    assert info["missing_keys"] == [] or set(info["missing_keys"]) <= {"lm_head.weight"}  # tied
    assert len(model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else model.transformer.h) == 2
    with safe_open(str(short / "model.safetensors"), "pt") as s, safe_open(str(base / "model.safetensors"), "pt") as b:
        assert set(s.keys()) < set(b.keys())  # some layers left out, nothing added
        for k in s.keys():
            assert torch.equal(s.get_tensor(k), b.get_tensor(k)), k
    check_trainable(short, default_validation_examples(n=2), bf16=True)  # raises PreflightError on failure


def test_a_base_too_shallow_or_with_unknown_layer_names_is_checked_whole(tmp_path):
    base = make_random_base("qwen3", tmp_path / "base")  # 2 layers: nothing to leave out
    assert short_base(base, tmp_path / "short", layers=2) is None
    assert not (tmp_path / "short").exists()
