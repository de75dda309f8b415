"""freeze, oft, LoRA+ and LoftQ train on the tiny model, lower the held-out loss, and send a delta against the
original base that goes through BitDelta; LoftQ is refused without CUDA, its delta contract checked on CPU."""

import pytest
import torch
from safetensors import safe_open

from zoo_gym import codec
from zoo_gym.codec import LoraFactors
from zoo_gym.gym_train import (Evaluator, HardwareError, TrainConfig, TrainConfigError, builtin_examples,
                               default_validation_examples, tiny_model_dir, train)

pytestmark = pytest.mark.slow
BASE = tiny_model_dir()
LAYERS = 4


def _base_shapes():
    with safe_open(str(BASE / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(scope="module")
def data():
    return builtin_examples("default", n=160, seed=1), default_validation_examples(16)


def _layers_of(keys):
    return {int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")}


CASES = {  # name -> (config, check of the delta's keys)
    "freeze": (dict(finetuning_type="freeze", learning_rate=1e-3),
               lambda keys: _layers_of(keys) == {2, 3} and all(k.startswith("model.layers.") for k in keys)),
    "freeze_first_mlp": (dict(finetuning_type="freeze", freeze_trainable_layers=-1, freeze_trainable_modules="mlp",
                              learning_rate=3e-3),
                         lambda keys: keys and all(k.startswith("model.layers.0.mlp.") for k in keys)),
    "oft": (dict(finetuning_type="oft", learning_rate=3e-3), lambda keys: len(keys) == 28),
    "loraplus": (dict(loraplus_lr_ratio=16.0, learning_rate=3e-3), lambda keys: len(keys) == 28),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_and_sends_a_bitdelta_delta_against_the_base(case, data):
    kw, keys_ok = CASES[case]
    ex, val = data
    r = train(BASE, ex, TrainConfig(max_steps=10, batch_size=8, warmup_steps=1, **kw), base_sha256="s",
              eval_examples=val)
    m = r.metadata
    assert m["loss_after"] < m["loss_before"], m
    assert keys_ok(set(r.delta)), sorted(r.delta)
    shapes = _base_shapes()
    for k, v in r.delta.items():
        full = v.merged() if isinstance(v, LoraFactors) else v
        assert tuple(full.shape) == shapes[k] and bool(full.abs().max() > 0), k
    decoded = codec.decode(codec.encode(r.delta, codec="bitdelta", group_size=None))
    assert set(decoded) == set(r.delta)
    assert all(tuple(decoded[k].shape) == shapes[k] for k in decoded)
    # the delta is the whole change: base + delta scores what the trained model scored
    assert Evaluator(BASE, val).loss(r.delta) == pytest.approx(m["loss_after"], rel=1e-4)


def test_freeze_layers_beyond_the_model_are_refused(data):
    with pytest.raises(ValueError, match="freeze_trainable_layers"):
        train(BASE, data[0][:32], TrainConfig(finetuning_type="freeze", freeze_trainable_layers=LAYERS + 1,
                                              max_steps=1, batch_size=8), base_sha256="s")
    with pytest.raises(TrainConfigError, match="`loraplus_lr_ratio`"):
        TrainConfig(finetuning_type="full", loraplus_lr_ratio=16.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_loftq_is_refused_without_cuda_in_one_line(data):
    with pytest.raises(HardwareError, match=r"^init_lora_weights='loftq' needs a CUDA GPU[^\n]*$"):
        train(BASE, data[0], TrainConfig(init_lora_weights="loftq"), base_sha256="s")


def _cpu_loftq_init(weight, num_bits, reduced_rank, num_iter=1):
    """PEFT's loftq_init (NF4 via bitsandbytes, then the SVD of the residual) on the CPU instead of 'cuda'."""
    import bitsandbytes as bnb

    w = weight.detach().float()
    q, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
    deq = bnb.functional.dequantize_4bit(q, state).float()
    U, S, Vh = torch.linalg.svd(w - deq, full_matrices=False)
    root = S[:reduced_rank].sqrt()
    return deq.to(weight.dtype), root[:, None] * Vh[:reduced_rank], U[:, :reduced_rank] * root


def test_loftq_delta_is_against_the_original_base(data, monkeypatch):
    """LoftQ changes W into Q(W): the delta must be merged - W, so base + delta is the trained model."""
    pytest.importorskip("bitsandbytes")
    from zoo_gym.gym_train import hardware

    monkeypatch.setattr(hardware, "check_cuda_options", lambda config: None)
    monkeypatch.setattr("peft.tuners.lora.layer.loftq_init", _cpu_loftq_init)
    ex, val = data
    r = train(BASE, ex, TrainConfig(init_lora_weights="loftq", max_steps=10, batch_size=8, warmup_steps=1,
                                    learning_rate=3e-3, device="cpu"), base_sha256="s", eval_examples=val)
    m = r.metadata
    assert m["delta_format"] == "dense" and m["loss_after"] < m["loss_before"]
    shapes = _base_shapes()
    assert len(r.delta) == 28 and all(tuple(v.shape) == shapes[k] for k, v in r.delta.items())
    assert Evaluator(BASE, val).loss(r.delta) == pytest.approx(m["loss_after"], rel=1e-4)
    decoded = codec.decode(codec.encode(r.delta, codec="bitdelta", group_size=None))
    assert set(decoded) == set(r.delta)
