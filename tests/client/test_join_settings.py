"""gym-client join: every TrainConfig field is a flag or a --config key; settings and data are checked
before the server is contacted (issue 13 item 1)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from typer.testing import CliRunner

from zoo_gym.client import join as join_module
from zoo_gym.client.cli import app
from zoo_gym.gym_train import TrainConfig


def _invoke(args, tmp_path):
    return CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), *args])


@pytest.fixture
def captured(monkeypatch):
    """Replace the join loop: keep the options and the TrainConfig it would train with."""
    seen = {}

    def fake_join(opts, *, say):
        seen["opts"] = opts
        seen["config"], _ = join_module.prepare(opts)
        return [{"round": 1, "contributor": "c"}]

    monkeypatch.setattr(join_module, "join", fake_join)
    return seen


def test_every_train_config_field_is_a_flag_in_help():
    res = CliRunner().invoke(app, ["join", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in res.output, f.name
    for flag in ("--config", "--epochs", "--lora-rank", "--cutoff-len", "--use-dora", "--no-use-dora",
                 "Training: LoRA", "Training: Hardware"):
        assert flag in res.output


def test_flags_reach_the_train_config(tmp_path, captured):
    res = _invoke(["--lora-r", "4", "--learning-rate", "1e-3", "--epochs", "2", "--batch-size", "8",
                   "--use-dora", "--use-rslora", "--init-lora-weights", "pissa", "--target-modules", "q_proj,v_proj",
                   "--gradient-accumulation-steps", "2", "--cutoff-len", "64", "--warmup-steps", "0",
                   "--weight-decay", "0.1", "--seed", "3", "--lora-alpha", "8", "--lora-dropout", "0.05",
                   "--device", "cpu", "--bf16", "--gradient-checkpointing", "--json"], tmp_path)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [{"round": 1, "contributor": "c"}]  # --json stays valid JSON
    c = captured["config"]
    assert (c.lora_r, c.learning_rate, c.batch_size, c.gradient_accumulation_steps, c.max_length) == (4, 1e-3, 8, 2, 64)
    assert c.use_dora and c.use_rslora and c.init_lora_weights == "pissa" and c.target_modules == ["q_proj", "v_proj"]
    assert (c.warmup_steps, c.weight_decay, c.seed, c.lora_alpha, c.lora_dropout) == (0, 0.1, 3, 8.0, 0.05)
    assert c.device == "cpu" and c.bf16 and c.gradient_checkpointing and not c.fp16
    # epochs become steps over the built-in 256 examples less 25 held out: ceil(231/8)=29 batches // 2 = 14 per epoch
    assert c.num_train_epochs is None and c.max_steps == 28


def test_distill_steps_reach_the_join_options_and_default_to_personalizes(tmp_path, captured):
    from zoo_gym.gym_train.distill import DEFAULT_DISTILL_STEPS

    assert _invoke(["--keep-variant", "--distill-steps", "0"], tmp_path).exit_code == 0
    assert captured["opts"].distill_steps == 0
    assert _invoke(["--keep-variant"], tmp_path).exit_code == 0
    assert captured["opts"].distill_steps == DEFAULT_DISTILL_STEPS


def test_config_file_with_llama_factory_names_and_flags_win(tmp_path, captured):
    y = tmp_path / "train.yaml"
    y.write_text("lora_rank: 16\nlearning_rate: 2e-4\nper_device_train_batch_size: 4\ncutoff_len: 128\n"
                 "lora_target: all\npissa_init: true\nnum_train_epochs: 1\nmethod: sft\nwarmup_steps: 0\n")
    res = _invoke(["--config", str(y), "--lora-r", "2"], tmp_path)
    assert res.exit_code == 0, res.output
    c = captured["config"]
    assert (c.stage, c.finetuning_type, c.lora_r, c.learning_rate, c.batch_size, c.max_length) == \
        ("sft", "full", 2, 2e-4, 4, 128)
    assert c.target_modules == "all-linear" and c.init_lora_weights == "pissa" and c.max_steps == 58
    t = tmp_path / "train.toml"
    t.write_text('[lora]\nr = 4\nuse_dora = true\n[schedule]\nmax-steps = 20\n')
    res = _invoke(["--config", str(t), "--max-steps", "30"], tmp_path)
    assert res.exit_code == 0, res.output
    c = captured["config"]
    assert (c.stage, c.finetuning_type, c.lora_r, c.use_dora, c.max_steps) == ("sft", "lora", 4, True, 30)


@pytest.mark.parametrize("text, message", [
    ("lora_rnk: 8\n", "unknown setting `lora_rnk`; did you mean `lora_rank`?"),
    ("learning_rat: 0.1\n", "did you mean `learning_rate`?"),
    ("lora_r: 8\nlora_rank: 4\n", "'lora_r' is given twice"),
    ("max_steps: 10\nepochs: 2\n", "either max_steps or num_train_epochs"),
    ("method: dpo\n", "method must be one of"),
    ("lora_r: [\n", "not valid YAML"),
])
def test_bad_config_files_exit_2_with_one_line_naming_the_key(tmp_path, no_network, text, message):
    y = tmp_path / "train.yaml"
    y.write_text(text)
    res = _invoke(["--config", str(y)], tmp_path)
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--max-steps", "1"], "warmup_steps (5) must be smaller than the round's 1 optimizer step"),
    (["--max-steps", "3", "--warmup-steps", "3"], "warmup_steps (3) must be smaller"),
    (["--lora-r", "0"], "`lora_r` must be an integer >= 1"),
    (["--bf16", "--fp16"], "`fp16` cannot be combined with bf16"),
    (["--device", "tpu"], "`device` must be one of"),
    (["--dp-noise-multiplier", "1.0", "--gradient-accumulation-steps", "2"], "`gradient_accumulation_steps` must be 1"),
    (["--distill-steps", "0"], "--distill-steps applies to the variants --keep-variant keeps"),
])
def test_impossible_settings_exit_2_before_any_work(tmp_path, no_network, args, message):
    t0 = time.monotonic()
    res = _invoke(args, tmp_path)
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and time.monotonic() - t0 < 10


def test_malformed_data_fails_at_once_without_contacting_the_server(tmp_path, no_network):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n{"instruction": "x"}\n')
    res = _invoke(["--data", str(bad)], tmp_path)
    assert res.exit_code == 2, res.output
    assert str(bad) in res.output and "line 2" in res.output and "'output'" in res.output
    assert "contacted" not in res.output


def test_library_join_checks_data_before_connecting(tmp_path, no_network):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completion": 3}\n')
    opts = join_module.JoinOptions(server="127.0.0.1:1", workdir=tmp_path, key_path=tmp_path / "k.pem",
                                   data=str(bad), train_overrides={"lora_r": 2})
    with pytest.raises(ValueError, match="line 1"):
        join_module.join(opts, say=lambda s: None)
