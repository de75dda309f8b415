"""A Liger training patches transformers' modeling module of the model's type for the whole process; `train`
undoes it (zoo_gym/gym_train/process_patches.py). Liger needs CUDA, so this replays its patches by hand
(the very assignments `apply_liger_kernel_to_qwen3` makes); tests/gpu runs the real one."""

from __future__ import annotations

import torch
from transformers.models.qwen3 import modeling_qwen3

from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.evaluation.evaluate import load_model
from zoo_gym.gym_train.process_patches import restored_modeling_module


def test_patches_made_while_training_are_undone_and_a_later_model_runs_on_the_cpu():
    norm, mlp, rope = modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3MLP, modeling_qwen3.apply_rotary_pos_emb
    forward = modeling_qwen3.Qwen3ForCausalLM.forward
    ids = torch.tensor([[5, 9, 11, 40]])
    want = load_model(tiny_model_dir())(input_ids=ids).logits

    class Broken(torch.nn.Module):  # stands in for a Triton kernel that cannot take a CPU tensor
        def __init__(self, *args, **kwargs):
            super().__init__()

        def forward(self, *args, **kwargs):
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    with restored_modeling_module(tiny_model_dir()):
        modeling_qwen3.Qwen3RMSNorm = modeling_qwen3.Qwen3MLP = Broken
        modeling_qwen3.apply_rotary_pos_emb = lambda *a, **k: None
        modeling_qwen3.Qwen3ForCausalLM.forward = lambda self, *a, **k: None
    assert modeling_qwen3.Qwen3RMSNorm is norm and modeling_qwen3.Qwen3MLP is mlp
    assert modeling_qwen3.apply_rotary_pos_emb is rope and modeling_qwen3.Qwen3ForCausalLM.forward is forward
    assert torch.equal(load_model(tiny_model_dir())(input_ids=ids).logits, want)
