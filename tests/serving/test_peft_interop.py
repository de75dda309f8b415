"""PEFT interop (issue 30 item 3): personalize --peft-out writes the trained LoRA factors as an adapter that
PeftModel.from_pretrained loads with the trained model's logits; a PEFT adapter directory is a gym-serve
variant (its merged delta BitDelta-coded), refused over other weights."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from zoo_gym.client.cli import app
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.serving.peft_adapter import peft_dense_delta, write_peft_adapter
from zoo_gym.serving.registry import VariantRegistry
from zoo_gym.serving.variant import weights_sha256

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 120, 64]])


def _merged_logits(base_dir, delta: dict) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, d in delta.items():
            state[name].add_(d.to(state[name].dtype))
        return model(IDS).logits


def _peft_logits(base_dir, adapter) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      str(adapter))
    with torch.no_grad():
        return model(IDS).logits


def _random_factors(base_dir, rank: int = 4, seed: int = 0) -> dict:
    from zoo_gym.codec import LoraFactors
    from zoo_gym.gym_train.delta import base_parameter_names

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in base_parameter_names(base_dir).items():
        if len(shape) == 2 and any(k in name for k in ("q_proj", "v_proj", "c_attn", "c_fc", "down_proj")):
            rows, cols = shape  # the base layout (GPT-2 Conv1D: (in, out)), as the trainer sends them
            r = rank * 2 if "down_proj" in name else rank  # mixed ranks: rank_pattern
            out[name] = LoraFactors(A=torch.randn(r, cols, generator=g) * 0.05,
                                    B=torch.randn(rows, r, generator=g) * 0.05)
    return out


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_factors_as_a_peft_adapter_give_the_merged_model_logits(tmp_path, family):
    base = make_random_base(family, tmp_path / "base")
    factors = _random_factors(base)
    adapter = write_peft_adapter(factors, tmp_path / "adapter", base_dir=base, base_sha256=weights_sha256(base),
                                 base_name="base")
    dense = {k: f.merged() for k, f in factors.items()}
    torch.testing.assert_close(_peft_logits(base, adapter), _merged_logits(base, dense), atol=1e-4, rtol=1e-4)
    got = peft_dense_delta(adapter)
    assert set(got) == set(dense) and all(torch.allclose(got[k], dense[k], atol=1e-6) for k in dense)


def test_personalize_peft_out_is_the_trained_lora(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i}.", "input": "", "output": f"{i} {i}"}) + "\n"
                            for i in range(8)))
    r = CliRunner().invoke(app, ["personalize", "--data", str(data), "--base", "tiny", "--out",
                                 str(tmp_path / "v.zgd"), "--max-steps", "2", "--warmup-steps", "0",
                                 "--learning-rate", "5e-2", "--distill-steps", "0", "--peft-out",
                                 str(tmp_path / "peft"), "--quiet"])
    assert r.exit_code == 0, r.output
    delta = peft_dense_delta(tmp_path / "peft")
    assert delta and any(d.abs().max() > 0 for d in delta.values())
    torch.testing.assert_close(_peft_logits(tiny_model_dir(), tmp_path / "peft"),
                               _merged_logits(tiny_model_dir(), delta), atol=1e-4, rtol=1e-4)


def test_a_peft_adapter_directory_is_a_served_variant_of_its_base_only(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_model_dir()
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False))
    variants = tmp_path / "variants"
    model.save_pretrained(variants / "peft-made")  # a foreign adapter: no zoo_gym base hash
    merged = {f"{k}.weight": m.get_delta_weight("default") for k, m in model.base_model.model.named_modules()
              if hasattr(m, "get_delta_weight") and hasattr(m, "lora_A")}
    ours = write_peft_adapter(_random_factors(base), variants / "ours", base_dir=base,
                              base_sha256=weights_sha256(base), base_name="tiny")
    reg = VariantRegistry(variants, base_sha256=weights_sha256(base))
    assert reg.names() == ["ours", "peft-made"]
    v = reg.get("peft-made")
    assert set(v.packed) == set(merged)
    for name, d in merged.items():  # BitDelta: the delta's signs, group scales of mean |delta|
        pw = v.packed[name]
        bits = torch.from_numpy(__import__("numpy").unpackbits(pw.signs.numpy(), axis=1, bitorder="little"))
        assert torch.equal(bits[:, :d.shape[1]].bool(), d > 0)
    other = VariantRegistry(variants, base_sha256="0" * 64)
    assert other.names() == ["peft-made"]  # ours names its base's hash; the foreign one is shape-checked only
    assert ours.is_dir()
