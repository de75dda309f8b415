"""Training never holds a second copy of the base beside the model it trains (issue 13 item 7: at
Qwen3-0.6B's size the base's state dict, loaded whole for every run, was 1.2 GB of the client's peak).
A plain LoRA run reads no base tensor at all; a full SFT run reads them one at a time for its delta."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from zoo_gym.codec import LoraFactors
from zoo_gym.gym_train import TrainConfig, builtin_examples, tiny_model_dir, train
from zoo_gym.gym_train.delta import BaseWeights, load_base_state

BASE = tiny_model_dir()


def test_base_weights_read_each_tensor_on_demand_and_equal_the_file():
    names, lazy = load_base_state(BASE)
    whole = load_file(str(BASE / "model.safetensors"))
    assert isinstance(lazy, BaseWeights) and set(lazy) == set(whole) and len(lazy) == len(whole)
    for k, v in whole.items():
        assert torch.equal(lazy[k], v), k
    assert set(names) <= set(whole) | {"lm_head.weight"}


def test_a_lora_run_reads_no_base_tensor_and_sft_reads_them_for_its_delta(monkeypatch):
    reads: list[str] = []
    original = BaseWeights.__getitem__

    def counting(self, name):
        reads.append(name)
        return original(self, name)

    monkeypatch.setattr(BaseWeights, "__getitem__", counting)
    examples = builtin_examples("default", n=24, seed=3)
    lora = train(BASE, examples, TrainConfig(method="lora", max_steps=2, batch_size=4, warmup_steps=0),
                 base_sha256="b" * 64)
    assert reads == []
    assert lora.delta and all(isinstance(v, LoraFactors) for v in lora.delta.values())

    sft = train(BASE, examples, TrainConfig(method="sft", max_steps=2, batch_size=4, warmup_steps=0,
                                            learning_rate=1e-3), base_sha256="b" * 64)
    assert reads  # the dense delta is trained minus base, read tensor by tensor
    assert any(float(v.abs().max()) > 0 for v in sft.delta.values())
