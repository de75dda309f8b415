"""Each optimizer trains the tiny model in full for a few steps (lower held-out loss), NEFTune runs, and the
options that need what this machine lacks (CUDA, a package) are refused in one line before any work."""

import importlib
import importlib.util

import pytest
import torch

from zoo_gym.gym_train import (HardwareError, TrainConfig, TrainConfigError, builtin_examples,
                               default_validation_examples, tiny_model_dir, train)
from zoo_gym.gym_train import hardware

pytestmark = pytest.mark.slow
BASE = tiny_model_dir()
PACKAGE = {"galore_adamw": "galore_torch", "apollo_adamw": "apollo_torch", "adam_mini": "adam_mini",
           "badam": "badam"}


@pytest.fixture(scope="module")
def data():
    return builtin_examples("default", n=96, seed=1), default_validation_examples(16)


@pytest.mark.parametrize("kw", [dict(optim="adamw_torch"), dict(optim="galore_adamw"), dict(optim="apollo_adamw"),
                                dict(optim="adam_mini"), dict(optim="muon"), dict(optim="badam"),
                                dict(neftune_noise_alpha=5.0)], ids=lambda kw: str(next(iter(kw.values()))))
def test_full_fine_tuning_lowers_the_heldout_loss(kw, data):
    package = PACKAGE.get(kw.get("optim"))
    if package and importlib.util.find_spec(package) is None:
        with pytest.raises(TrainConfigError, match=r"pip install 'zoo-gym\[optimizers\]'"):
            TrainConfig(finetuning_type="full", **kw)
        return
    ex, val = data
    cfg = TrainConfig(finetuning_type="full", max_steps=6, batch_size=8, warmup_steps=1, learning_rate=1e-3, **kw)
    m = train(BASE, ex, cfg, base_sha256="o", eval_examples=val).metadata
    assert m["steps"] == 6 and m["loss_after"] < m["loss_before"], m


@pytest.mark.parametrize("kw, field", [(dict(optim="adam_mini"), "optim"), (dict(optim="nadam"), "optim"),
                                        (dict(optim="muon", loraplus_lr_ratio=4.0, finetuning_type="lora"), "optim"),
                                        (dict(optim="sgd", dp_noise_multiplier=1.0), "optim"),
                                        (dict(flash_attn="fa3"), "flash_attn"),
                                        (dict(flash_attn="sdpa", attn_implementation="eager"), "flash_attn")])
def test_impossible_combinations_name_the_field(kw, field):
    with pytest.raises(TrainConfigError, match=f"`{field}`"):
        TrainConfig(**kw)  # adam_mini: the default finetuning_type is lora


def test_flash_attn_sets_attn_implementation():
    assert TrainConfig(flash_attn="disabled").attn_implementation == "eager"
    assert TrainConfig(flash_attn="fa2").attn_implementation == "flash_attention_2"


CUDA_ONLY = [dict(use_liger_kernel=True), dict(use_unsloth=True), dict(flash_attn="fa2"),
             dict(init_lora_weights="loftq")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("kw", CUDA_ONLY, ids=lambda kw: next(iter(kw)))
def test_cuda_only_options_are_refused_in_one_line_before_any_work(kw, data, monkeypatch):
    module = importlib.import_module("zoo_gym.gym_train.train")  # the package re-exports the function train
    monkeypatch.setattr(module, "load_base_state", lambda *a: pytest.fail("work started before the check"))
    with pytest.raises(HardwareError, match=r"^[^\n]*CUDA GPU[^\n]*$"):
        train(BASE, data[0], TrainConfig(**kw), base_sha256="c")


@pytest.mark.parametrize("kw", CUDA_ONLY, ids=lambda kw: next(iter(kw)))
def test_cuda_only_options_pass_the_check_where_cuda_is_present(kw, monkeypatch):
    from zoo_gym.gym_train.common import common_training_args

    cfg = TrainConfig(**kw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # liger-kernel, unsloth, flash-attn
    hardware.check_hardware(cfg)  # no HardwareError
    args = common_training_args(cfg, "/tmp/zoo_gym_unused", progress=False)
    assert args["use_liger_kernel"] == bool(kw.get("use_liger_kernel"))  # passed through to TrainingArguments


def test_trl_head_chunks_are_narrow_on_the_cpu_and_trls_own_elsewhere():
    """TRL's fused output layer copies each vocabulary chunk to float32 in its CPU backward: a CPU run uses
    narrower chunks (the peak of gym-server init's LoRA step), a CUDA run keeps TRL's."""
    import trl.trainer.utils as trl_utils

    from zoo_gym.gym_train.common import CPU_HEAD_CHUNK_ROWS, fit_head_chunks

    fit_head_chunks(torch.device("cpu"))
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == CPU_HEAD_CHUNK_ROWS
    fit_head_chunks(torch.device("cuda"))
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == fit_head_chunks.trl_default > CPU_HEAD_CHUNK_ROWS
    fit_head_chunks(torch.device("cpu"))
