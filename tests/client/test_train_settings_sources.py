"""Every training setting of gym-client join (a TrainConfig field) can be set three ways: flag, environment
variable ZOO_GYM_<KEY>, --config file; precedence flag > environment > file > default (through `join` itself,
up to the options it would run with)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zoo_gym.client import join as join_module
from zoo_gym.client.cli import app
from zoo_gym.client.train_settings import train_leaves

LEAVES = train_leaves()
SPECIAL = {"method": "sft", "stage": "dpo", "finetuning_type": "full", "loss_type": "ipo", "target_modules": ["q_proj", "v_proj"], "init_lora_weights": "pissa",
           "importance_sampling_level": "sequence", "device": "cpu", "quantization": "4bit",
           "attn_implementation": "sdpa", "report_to": "wandb", "num_train_epochs": 2.0,
           "dp_noise_multiplier": 0.5, "dp_target_epsilon": 8.0, "loftq_bits": 8, "optim": "sgd",
           "freeze_trainable_modules": "mlp", "optim_target_modules": ["q_proj", "v_proj"], "flash_attn": "sdpa",
           "lr_scheduler_type": "cosine", "max_samples": 100, "logging_steps": 3,
           "reward_funcs": "zoo_gym.gym_train.grpo:format_reward", "reward_weights": ["1", "0.5"],
           "reward_model": "reward_models/mine"}


@pytest.fixture
def run(monkeypatch, tmp_path):
    """join up to its options: returns (exit code, output, TrainConfig overrides)."""
    seen = {}
    monkeypatch.setattr(join_module, "join", lambda opts, say: seen.update(opts=opts) or [])

    def invoke(args, env=None, file_values=None):
        seen.clear()
        if file_values is not None:
            path = tmp_path / "train.toml"
            path.write_text("".join(f"{k.replace('_', '-')} = {json.dumps(v)}\n" for k, v in file_values.items()))
            args = [*args, "--config", str(path)]
        res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), *args],
                                 env=env or {})
        opts = seen.get("opts")
        return res.exit_code, res.output, opts.train_overrides if opts else None

    return invoke


def _value(leaf):
    if leaf.key in SPECIAL:
        return SPECIAL[leaf.key]
    if leaf.kind is bool:
        return not leaf.default
    return leaf.default + 1 if leaf.kind is int else (leaf.default or 0.25) * 2


def _text(value):
    return str(value).lower() if isinstance(value, bool) else ",".join(value) if isinstance(value, list) else str(value)


def _flag(leaf, value):
    if leaf.key == "method":
        return ["--method", value]
    if leaf.kind is bool:
        return [leaf.flag if value else "--no-" + leaf.flag[2:]]
    return [leaf.flag, _text(value)]


@pytest.mark.parametrize("leaf", LEAVES, ids=[leaf.key for leaf in LEAVES])
def test_each_training_setting_is_set_by_flag_env_and_file(leaf, run):
    value = _value(leaf)
    assert value != leaf.default
    for args, env, file_values in (_flag(leaf, value), None, None), ([], {leaf.env: _text(value)}, None), \
                                  ([], None, {leaf.key: value}):
        code, output, got = run(args, env=env, file_values=file_values)
        assert code == 0 and got is not None, output
        if leaf.key == "method":  # deprecated: it sets the stage and fine-tuning type, and says so once
            assert (got["stage"], got["finetuning_type"]) == ("sft", "full") and "method" not in got
            assert "is deprecated: use --stage sft --finetuning-type full" in output
        else:
            assert got[leaf.key] == value


def test_precedence_is_flag_then_env_then_file_then_default(run):
    env = {"ZOO_GYM_LORA_R": "5", "ZOO_GYM_SEED": "6", "ZOO_GYM_NUM_TRAIN_EPOCHS": "2"}
    code, output, o = run(["--lora-r", "4"], env=env, file_values={"lora_r": 7, "seed": 8, "lora_alpha": 9.0,
                                                                             "max_steps": 10})
    assert code == 0, output
    assert (o["lora_r"], o["seed"], o["lora_alpha"], o["num_train_epochs"]) == (4, 6, 9.0, 2.0)
    # epochs from the environment beat the file's max_steps
    assert "max_steps" not in o and "learning_rate" not in o and "stage" not in o


def test_bad_env_value_is_one_line_naming_the_variable(run):
    code, output, _ = run([], env={"ZOO_GYM_LORA_R": "eight"})
    assert code == 2 and "ZOO_GYM_LORA_R='eight'" in output and "integer" in output, output
    assert len(output.strip().splitlines()) == 1


def test_method_contradicting_the_stage_is_refused_in_one_line(run):
    code, output, _ = run(["--method", "grpo", "--stage", "dpo"])
    assert code == 2 and "--method grpo means stage 'grpo', but stage is 'dpo'" in output, output
    assert len(output.strip().splitlines()) == 1
