"""LLaMA-Factory's example configs and TRL's keys are accepted as written by `gym-client join --config`: the
settings a round takes are honoured, the ones the server or client decides are set aside with one warning
each, `--dry-run` prints the resolved round as JSON without contacting a server, and hints never suggest a
setting of another meaning."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zoo_gym.client import join as join_module
from zoo_gym.client.cli import app
from zoo_gym.client.ecosystem_keys import reason
from zoo_gym.client.train_settings import TrainSettingsError, resolve, train_leaves
from zoo_gym.gym_train import TrainConfig
from zoo_gym.gym_train.common import common_training_args

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "ecosystem"
SET_ASIDE = {"model_name_or_path", "trust_remote_code", "do_train", "dataset", "template", "overwrite_cache",
             "preprocessing_num_workers", "output_dir", "save_steps", "plot_loss", "overwrite_output_dir",
             "ddp_timeout"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"repeat {i}", "input": "", "output": str(i)}) + "\n"
                            for i in range(40)))
    return path


def dry_run(tmp_path, *args, data=None):
    """(exit code, the JSON doc or None, stderr lines) of `join --dry-run` against a closed port."""
    argv = ["join", "--server", f"127.0.0.1:{_closed_port()}", "--workdir", str(tmp_path / "home"),
            "--key", str(tmp_path / "home" / "key.pem"), "--dry-run", *(["--data", str(data)] if data else []),
            *args]
    res = CliRunner().invoke(app, argv)
    doc = json.loads(res.stdout) if res.exit_code == 0 else None
    return res.exit_code, doc, res.stderr.splitlines()


def _warned(lines):
    return {m.group(1) for line in lines if (m := re.match(r"warning: `([a-z_]+)` ", line))}


def test_llama_factory_lora_sft_is_accepted_as_written(tmp_path, data, monkeypatch):
    monkeypatch.setattr(join_module, "join", lambda *a, **k: pytest.fail("dry-run must not join"))
    t0 = time.monotonic()
    code, doc, lines = dry_run(tmp_path, "--config", str(FIXTURES / "llama3_lora_sft.yaml"), data=data)
    assert code == 0, lines
    assert time.monotonic() - t0 < 30 and not (tmp_path / "home").exists()  # no key, no cache, no server
    t = doc["training"]
    assert (t["stage"], t["finetuning_type"], t["lora_r"], t["target_modules"]) == ("sft", "lora", 8, "all-linear")
    assert (t["max_length"], t["batch_size"], t["gradient_accumulation_steps"]) == (2048, 1, 8)
    assert (t["lr_scheduler_type"], t["warmup_ratio"], t["learning_rate"], t["bf16"]) == ("cosine", 0.1, 1e-4, True)
    assert (t["max_samples"], t["logging_steps"]) == (1000, 10)
    # 3 epochs over 36 training examples (4 held out) at 1 x 8 per step: 4 steps each; ceil(0.1 x 12) warm-up
    assert (t["num_train_epochs"], t["max_steps"], t["warmup_steps"]) == (None, 12, 2)
    assert doc["data"] == {"path": str(data), "format": "alpaca", "examples": 40, "train_examples": 36,
                           "held_out_examples": 4}
    assert _warned(lines) == SET_ASIDE and set(TrainConfig.__dataclass_fields__) == set(t)
    assert all(line.startswith("warning: ") for line in lines) and len(lines) == len(SET_ASIDE)
    assert len(doc["warnings"]) == len(SET_ASIDE)
    assert any("server's current checkpoint" in w for w in doc["warnings"] if w.startswith("`model_name_or_path`"))


@pytest.mark.parametrize("name, stage, kind, extra", [
    ("llama3_lora_dpo.yaml", "dpo", "lora", {"beta": 0.1, "loss_type": "sigmoid"}),
    ("llama3_lora_kto.yaml", "kto", "lora", {"beta": 0.1, "report_to": "none"}),
    ("llama3_full_sft.yaml", "sft", "full", {"gradient_accumulation_steps": 2}),
    ("qwen3_lora_sft.yaml", "sft", "lora", {"lora_r": 8}),
])
def test_other_llama_factory_examples_resolve(tmp_path, name, stage, kind, extra):
    code, doc, lines = dry_run(tmp_path, "--config", str(FIXTURES / name))  # built-in data
    assert code == 0, lines
    t = doc["training"]
    assert (t["stage"], t["finetuning_type"], t["lr_scheduler_type"], t["max_length"]) == (stage, kind, "cosine",
                                                                                        2048)
    assert {k: t[k] for k in extra} == extra
    assert doc["data"]["format"] == "builtin" and doc["data"]["examples"] == 256
    warned = _warned(lines)
    assert {"model_name_or_path", "output_dir", "save_steps", "dataset", "template"} <= warned
    if name == "llama3_full_sft.yaml":  # its eval keys are live, and it names DeepSpeed
        assert {"deepspeed", "val_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps"} <= warned
        assert "does not apply" in next(line for line in lines if "`deepspeed`" in line)
        assert "holds out its own evaluation set" in next(line for line in lines if "`val_size`" in line)
    if name == "qwen3_lora_sft.yaml":  # resume_from_checkpoint: null asks nothing
        assert {"save_only_model", "dataloader_num_workers"} <= warned and "resume_from_checkpoint" not in warned
    assert len(lines) == len(warned) == len(doc["warnings"])


def test_trl_keys_resolve_and_reach_the_trainer(tmp_path, data):
    code, doc, lines = dry_run(tmp_path, "--config", str(FIXTURES / "trl_keys.yaml"), data=data)
    assert code == 0, lines
    t = doc["training"]
    assert (t["max_grad_norm"], t["logging_steps"], t["seed"], t["packing"], t["assistant_only_loss"]) == \
        (0.5, 5, 42, True, True)
    assert _warned(lines) == {"save_steps", "save_strategy", "output_dir"}
    # 1 epoch over 36 examples at 4 x 2: 4 steps; ceil(0.05 x 4) = 1 warm-up step
    assert (t["max_steps"], t["warmup_steps"]) == (4, 1)
    code, doc, lines = dry_run(tmp_path, "--config", str(FIXTURES / "trl_grpo.yaml"), data=data)
    assert code == 0, lines
    t = doc["training"]
    assert (t["stage"], t["num_generations"], t["beta"], t["loss_type"], t["temperature"]) == \
        ("sft", 4, 0.04, "dr_grpo", 0.9)
    assert (t["lr_scheduler_type"], t["warmup_steps"], t["max_completion_length"]) == ("constant_with_warmup", 2, 32)
    assert _warned(lines) == {"max_prompt_length", "output_dir", "run_name", "save_strategy"}


def test_common_training_args_carry_the_schedule_and_the_warmup_ratio(tmp_path):
    cfg = TrainConfig(max_steps=40, lr_scheduler_type="cosine", warmup_ratio=0.1, max_grad_norm=0.3,
                      logging_steps=7)
    args = common_training_args(cfg, str(tmp_path), progress=False)
    assert (args["lr_scheduler_type"], args["warmup_steps"], args["max_grad_norm"], args["logging_steps"]) == \
        ("cosine", 4, 0.3, 7)
    from transformers import TrainingArguments

    ta = TrainingArguments(**args)
    assert ta.lr_scheduler_type == "cosine" and ta.get_warmup_steps(40) == 4 and ta.max_grad_norm == 0.3
    plain = common_training_args(TrainConfig(max_steps=40), str(tmp_path), progress=False)
    assert (plain["lr_scheduler_type"], plain["warmup_steps"], plain["logging_steps"]) == ("linear", 5, 4)


def test_warmup_ratio_and_steps_exclude_each_other():
    with pytest.raises(TrainSettingsError, match="set either warmup_steps or warmup_ratio, not both"):
        resolve({"warmup_steps": 3, "warmup_ratio": 0.1}, None, environ={})
    overrides, _ = resolve({"warmup_steps": 3}, None, environ={"ZOO_GYM_WARMUP_RATIO": "0.2"})
    assert overrides == {"warmup_steps": 3}  # the flag wins over the environment's ratio


@pytest.mark.parametrize("args, message", [
    (["--lr-scheduler-type", "cosine_with_min_lr"], "`lr_scheduler_type` must be one of"),
    (["--warmup-ratio", "1.5"], "`warmup_ratio` must be in [0, 1)"),
    (["--max-steps", "2", "--warmup-ratio", "0.9"], "warmup_ratio 0.9 gives 2 warm-up steps"),
    (["--stage", "dpo", "--packing"], "`packing` applies to the sft stage only"),
])
def test_bad_trainer_settings_exit_2_in_one_line(tmp_path, args, message):
    code, _, lines = dry_run(tmp_path, *args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_max_samples_caps_the_examples(tmp_path, data):
    code, doc, lines = dry_run(tmp_path, "--max-samples", "20", data=data)
    assert code == 0, lines
    assert (doc["data"]["examples"], doc["data"]["train_examples"]) == (20, 18)


# TRL / transformers / LLaMA-Factory keys this client takes under their own names
ACCEPTED = ("learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "max_grad_norm", "max_steps",
            "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "weight_decay",
            "logging_steps", "seed", "bf16", "fp16", "gradient_checkpointing", "report_to", "max_length",
            "packing", "assistant_only_loss", "completion_only_loss", "beta", "loss_type", "num_generations",
            "max_completion_length", "temperature", "importance_sampling_level", "cutoff_len", "lora_rank",
            "lora_target", "lora_alpha", "lora_dropout", "pref_beta", "pref_loss", "max_samples", "stage",
            "finetuning_type", "train_on_prompt")


def test_ecosystem_keys_are_accepted_and_refused_ones_never_hint_another_meaning():
    from trl import DPOConfig, GRPOConfig, KTOConfig, SFTConfig

    from zoo_gym.settings import SettingError, collect

    spec = train_leaves()
    names = {a for leaf in spec for a in (leaf.key, *leaf.aliases)}
    assert set(ACCEPTED) <= names
    trl_keys = {f.name for c in (SFTConfig, DPOConfig, GRPOConfig, KTOConfig) for f in dataclasses.fields(c)}
    refused = sorted(k for k in trl_keys if k not in names and reason(k) is None)
    assert "max_grad_norm" not in refused and "save_steps" not in refused
    for key in [*refused, "optim", "adam_beta1", "num_iterations", "quantization_bit", "flash_attn"]:
        with pytest.raises(SettingError) as info:
            collect(spec, file_values={key: 1})
        assert "did you mean" not in str(info.value), (key, str(info.value)[:120])
    for typo, meant in (("learnin_rate", "learning_rate"), ("lora_rnk", "lora_rank"), ("max_grad_nrom", "max_grad_norm"),
                        ("warmup_ration", "warmup_ratio"), ("lr_schedular_type", "lr_scheduler_type")):
        with pytest.raises(SettingError, match=f"did you mean `{meant}`"):
            collect(spec, file_values={typo: 1})
