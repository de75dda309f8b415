"""GPT-2 Conv1D LoRA factors in the base's layout, and the plain chat-template fallback (issue 13 item 3)."""

from __future__ import annotations

import torch

from zoo_gym.evaluation.chat import PLAIN_TEMPLATE, check_template, render_pair
from zoo_gym.gym_train.delta import load_base_state, lora_factors, merged_lora_delta
from zoo_gym.evaluation.evaluate import load_model, load_tokenizer, tokenize_examples
from zoo_gym.gym_train.families import make_random_base


def test_conv1d_lora_factors_merge_to_the_base_layout_exactly(tmp_path):
    from peft import LoraConfig, get_peft_model

    # Prepare: GPT-2 with LoRA on its Conv1D layers, B made non-zero so the delta is not trivially 0
    base = make_random_base("gpt2", tmp_path / "gpt2")
    names, base_state = load_base_state(base)
    model = get_peft_model(load_model(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    # Execute
    factors = lora_factors(model)
    reference = merged_lora_delta(model, base_state, names)  # merge_and_unload() - base: PEFT's own layout
    # Assert
    assert "transformer.h.0.attn.c_attn.weight" in factors
    assert base_state["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    assert set(factors) == set(reference)
    for k, f in factors.items():
        assert f.shape == tuple(base_state[k].shape)
        assert reference[k].abs().max() > 0
        torch.testing.assert_close(f.merged(), reference[k], atol=1e-6, rtol=1e-5)


def test_a_base_without_template_gets_the_plain_format(tmp_path):
    base = make_random_base("llama", tmp_path / "llama", chat_template=False, pad_token=False)
    tok = load_tokenizer(base)
    assert tok.chat_template == PLAIN_TEMPLATE and tok.pad_token == tok.eos_token
    check_template(tok)
    prompt, completion = render_pair(tok, {"instruction": "Add.", "input": "2+3", "output": "5", "system": "Be brief."})
    assert prompt == "Be brief.\n\n### Instruction:\nAdd.\n2+3\n\n### Response:\n"
    assert completion == "5" + tok.eos_token
    (p, c), = tokenize_examples(tok, [{"instruction": "Add.", "input": "2+3", "output": "5"}])
    assert c[-1] == tok.eos_token_id and len(p) > 0


def test_a_shipped_template_is_used_as_is(tmp_path):
    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.evaluation.chat import render_completion, render_prompt

    tok = load_tokenizer(tiny_model_dir())
    ex = {"instruction": "Compute.", "input": "2+3", "output": "5"}
    assert render_pair(tok, ex) == (render_prompt(ex), render_completion(ex))
