"""TrainConfig's contributor-facing fields: epochs, accumulation, precision, checkpointing, device."""

import pytest
import torch

from zoo_gym.gym_train import TrainConfig, TrainConfigError, tiny_model_dir, train
from zoo_gym.gym_train.tasks import builtin_examples
from zoo_gym.gym_train.common import common_training_args


def test_epochs_become_steps_as_the_trainer_counts_them():
    assert TrainConfig(max_steps=7).steps_for(1000) == 7  # without epochs, max_steps
    assert TrainConfig(num_train_epochs=1, batch_size=8).steps_for(100) == 13  # ceil(100 / 8)
    assert TrainConfig(num_train_epochs=2, batch_size=8, gradient_accumulation_steps=2).steps_for(100) == 12
    assert TrainConfig(num_train_epochs=0.5, batch_size=8).steps_for(100) == 7
    assert TrainConfig(method="grpo", num_train_epochs=1, batch_size=16, num_generations=8).steps_for(10) == 5


@pytest.mark.parametrize("kwargs, field", [
    ({"num_train_epochs": 0}, "num_train_epochs"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"device": "tpu"}, "device"),
    ({"bf16": True, "fp16": True}, "fp16"),
    ({"dp_noise_multiplier": 1.0, "bf16": True}, "bf16"),
    ({"dp_noise_multiplier": 1.0, "gradient_checkpointing": True}, "gradient_checkpointing"),
    ({"dp_target_epsilon": 3.0, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
])
def test_impossible_values_name_the_field(kwargs, field):
    with pytest.raises(TrainConfigError, match=f"`{field}`"):
        TrainConfig(**kwargs)


def test_settings_reach_the_trainer_arguments(tmp_path):
    args = common_training_args(TrainConfig(gradient_accumulation_steps=3, bf16=True, gradient_checkpointing=True,
                                            device="cpu"), str(tmp_path), progress=False)
    assert args["gradient_accumulation_steps"] == 3 and args["bf16"] and not args["fp16"]
    assert args["gradient_checkpointing"] and args["use_cpu"]
    auto = common_training_args(TrainConfig(), str(tmp_path), progress=False)
    assert auto["use_cpu"] == (not torch.cuda.is_available()) and auto["gradient_accumulation_steps"] == 1
    assert not auto["bf16"] and not auto["gradient_checkpointing"]


def test_gradient_accumulation_trains(tmp_path):
    ex = builtin_examples("default", n=24)
    r = train(tiny_model_dir(), ex, TrainConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2,
                                                warmup_steps=0, device="cpu"), base_sha256="s")
    assert r.metadata["steps"] == 2
    assert any(float(v.B.abs().sum()) > 0 for v in r.delta.values())  # a real, non-zero LoRA update
