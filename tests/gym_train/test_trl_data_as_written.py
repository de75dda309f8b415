"""TRL users' data and configs as they write them: prompt-only GRPO records (string or message prompts) with
their own answer column handed to reward functions by its own name, TRL keys about where a run executes set
aside with one warning (a misspelling still refused), and a warning for a learning rate far above its stage's
usual range."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from zoo_gym.client.train_settings import TrainSettingsError, resolve
from zoo_gym.gym_train import TrainConfig, load_examples, tiny_model_dir, train
from zoo_gym.gym_train.config import learning_rate_warning, usual_max_learning_rate
from zoo_gym.gym_train.errors import DataError
from zoo_gym.gym_train.formats import check_stage_data
from zoo_gym.gym_train.rewards_loader import RewardFuncError, check_reward_funcs

BASE = tiny_model_dir()
RL = dict(max_steps=1, batch_size=8, num_generations=4, max_completion_length=4, grpo_eval_prompts=4, warmup_steps=0)


def _prompt_only_file(tmp_path: Path, n: int = 16) -> Path:
    """TRL prompt-only records, half with a string prompt and half with a message list, answer in `solution`."""
    lines = []
    for i in range(n):
        question = f"What is {i} + {i + 1}? Answer with only the number."
        prompt = question if i % 2 else [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": question}]
        lines.append(json.dumps({"prompt": prompt, "solution": str(2 * i + 1), "level": i % 3}))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_only_records_keep_their_columns_by_name(tmp_path):
    examples = load_examples(_prompt_only_file(tmp_path, n=4), allow_text=True)
    assert examples[0] == {"instruction": "What is 0 + 1? Answer with only the number.", "input": "",
                           "system": "Be brief.", "columns": {"solution": "1", "level": 0}, "where": "line 1"}
    assert examples[1] == {"instruction": "What is 1 + 2? Answer with only the number.", "input": "",
                           "columns": {"solution": "3", "level": 1}, "where": "line 2"}
    for stage in ("grpo", "rloo", "gspo"):
        check_stage_data(stage, examples)
    for stage in ("sft", "dpo", "kto"):
        with pytest.raises(DataError, match=f"line 1: field 'completion': missing: stage '{stage}' needs an "
                                            "answer in every record, and this one is prompt-only") as e:
            check_stage_data(stage, examples, source="prompts.jsonl")
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompt, field, problem", [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], r"prompt\[1\].role",
     "must end with a user turn"),
    ("  ", "prompt", "is empty"),
    ([], "prompt", "non-empty list"),
])
def test_a_malformed_prompt_only_record_names_its_field(tmp_path, prompt, field, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "solution": "1"}) + "\n")
    with pytest.raises(DataError, match=problem) as e:
        load_examples(path, allow_text=True)
    assert e.value.field == field.replace("\\", "")


def test_a_column_named_like_trls_own_argument_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "completions": "x"}) + "\n")
    with pytest.raises(DataError, match="rename the column"):
        load_examples(path, allow_text=True)


def test_validation_data_without_answers_is_still_refused(tmp_path):
    """The server's validation sets are loaded without allow_text: every record needs an answer there."""
    with pytest.raises(DataError, match="prompt-only record"):
        load_examples(_prompt_only_file(tmp_path, n=2))


def test_the_built_in_reward_names_the_missing_answer_column(tmp_path):
    examples = load_examples(_prompt_only_file(tmp_path, n=4), allow_text=True)
    with pytest.raises(RewardFuncError, match="no `answer` column \\(its columns: `solution`, `level`\\)"):
        check_reward_funcs(TrainConfig(stage="grpo"), examples)
    renamed = [{**ex, "columns": {"answer": ex["columns"]["solution"]}} for ex in examples]
    assert check_reward_funcs(TrainConfig(stage="grpo"), renamed) is None  # the built-ins, satisfied


@pytest.mark.slow
def test_grpo_on_trl_prompt_only_data_passes_the_solution_column_to_a_reward(tmp_path):
    log = tmp_path / "seen.jsonl"
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(f"""
        import json

        def reward(completions, solution, **kw):
            with open({str(log)!r}, "a") as f:
                f.write(json.dumps({{"solution": solution, "level": kw.get("level"), "keys": sorted(kw),
                                     "trained": kw.get("trainer_state") is not None}}) + "\\n")
            return [float(c[-1]["content"].strip() == s) for c, s in zip(completions, solution)]
        """))
    examples = load_examples(_prompt_only_file(tmp_path), allow_text=True)
    cfg = TrainConfig(stage="grpo", reward_funcs=f"{reward}:reward", **RL)
    r = train(BASE, examples[4:], cfg, base_sha256="p", eval_examples=examples[:4])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    trained = [c for c in calls if c["trained"]]
    assert len(trained) == 1 and len(trained[0]["solution"]) == 8  # one step: 2 prompts x 4 generations
    solutions = {str(2 * i + 1) for i in range(16)}
    assert set(trained[0]["solution"]) <= solutions and len(set(trained[0]["solution"])) == 2
    assert {"prompts", "completion_ids", "level"} <= set(trained[0]["keys"])
    assert "answer" not in trained[0]["keys"]  # no renamed copy: the column arrives as TRL passes it
    held = [c for c in calls if not c["trained"] and len(c["solution"]) == 4]  # the held-out reward, before/after
    assert held and all(c["solution"] == ["1", "3", "5", "7"] for c in held)
    m = r.metadata
    assert m["steps"] == 1 and m["reward_funcs"] == ["reward"]
    assert m["reward_before"] is not None and m["loss_before"] is None  # no answer to measure a loss on


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_trl_grpo_config_with_vllm_is_taken_with_one_warning_naming_the_keys(tmp_path):
    path = _file(tmp_path, """
        learning_rate: 1.0e-5
        num_generations: 4
        use_vllm: true
        vllm_mode: colocate
        vllm_gpu_memory_utilization: 0.3
        hub_strategy: every_save
        logging_first_step: true
        """)
    overrides, warnings = resolve({"stage": "grpo"}, path)
    assert overrides == {"learning_rate": 1e-5, "num_generations": 4, "stage": "grpo"}
    local = [w for w in warnings if "do not apply" in w]
    assert len(local) == 1 and len(warnings) == 1
    for key in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "hub_strategy", "logging_first_step"):
        assert f"`{key}`" in local[0]
    TrainConfig(**overrides)  # the round's config builds from what is left


@pytest.mark.slow
def test_a_round_trains_from_a_config_with_use_vllm(tmp_path):
    from zoo_gym.gym_train import builtin_examples

    path = _file(tmp_path, """
        use_vllm: true
        max_steps: 1
        per_device_train_batch_size: 8
        num_generations: 4
        max_completion_length: 4
        warmup_steps: 0
        """)
    overrides, warnings = resolve({"stage": "grpo"}, path)
    assert len(warnings) == 1 and "`use_vllm`" in warnings[0]
    cfg = TrainConfig(**overrides, grpo_eval_prompts=2)
    r = train(BASE, builtin_examples("grpo", n=16), cfg, base_sha256="v")
    assert r.metadata["steps"] == 1


@pytest.mark.parametrize("key", ["use_vlm", "vllm_modee", "hub_strategyy"])
def test_a_key_trl_does_not_have_is_still_refused(tmp_path, key):
    with pytest.raises(TrainSettingsError, match=f"unknown setting `{key}`"):
        resolve({}, _file(tmp_path, f"{key}: true\n"))


def test_a_null_local_run_key_is_dropped_without_a_word(tmp_path):
    assert resolve({}, _file(tmp_path, "use_vllm: null\nlearning_rate: 1.0e-3\n")) == ({"learning_rate": 1e-3}, [])


def test_a_learning_rate_far_too_high_warns_and_the_default_does_not(tmp_path):
    assert resolve({}, None) == ({}, [])  # the defaults: lora sft at 3e-3
    assert resolve({"stage": "dpo"}, None)[1] == []  # the default is within every stage's usual range
    assert resolve({"finetuning_type": "full"}, None)[1] == []
    _, warnings = resolve({"learning_rate": 0.5}, None)
    assert len(warnings) == 1 and warnings[0].startswith("learning_rate 0.5 is 16.7x the top of the usual range "
                                                         "for lora sft (0.03)")
    _, warnings = resolve({"stage": "dpo"}, _file(tmp_path, "learning_rate: 0.05\n"))
    assert len(warnings) == 1 and "lora dpo (0.003)" in warnings[0]
    assert resolve({"stage": "grpo", "learning_rate": 1e-2}, None)[1] == []  # the RL tests' rate on the tiny model


def test_the_usual_ranges_are_gentler_for_preferences_and_full_fine_tuning():
    assert usual_max_learning_rate("sft", "lora") == pytest.approx(3e-2)
    assert usual_max_learning_rate("dpo", "lora") == pytest.approx(3e-3)
    assert usual_max_learning_rate("sft", "full") == pytest.approx(3e-3)
    assert usual_max_learning_rate("kto", "full") == pytest.approx(3e-3)  # not compounded
    assert learning_rate_warning("dpo", "lora", 3e-3) is None
