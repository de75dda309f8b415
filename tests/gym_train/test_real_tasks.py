"""The built-in task families for a real instruct base (real_tasks.py, registered in tasks.py): exact answers,
deterministic, disjoint shards; their answer pairs and GRPO prompt-only records; `--task` on the client."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from zoo_gym.client.cli import app
from zoo_gym.gym_train.grpo import exact_answer_reward, format_reward
from zoo_gym.gym_train.tasks import (PAIR_TASKS, builtin_examples, builtin_task, check_task_stage,
                                     prompt_only_records)

REAL = ("arithmetic", "sort_words")
_ARITH = re.compile(r"What is (\d+) ([+-]) (\d+)\? Answer with only the number\.")


def _prompts(examples):
    return {(ex["instruction"], ex["input"]) for ex in examples}


@pytest.mark.parametrize("task", REAL)
def test_families_are_deterministic_by_seed(task):
    a = builtin_examples(task, n=50, shard=1, n_shards=3, seed=7)
    assert a == builtin_examples(task, n=50, shard=1, n_shards=3, seed=7)
    assert a != builtin_examples(task, n=50, shard=1, n_shards=3, seed=8)


@pytest.mark.parametrize("task", REAL + ("arithmetic-pairs",))
def test_shards_are_disjoint_from_each_other_and_from_validation(task):
    shards = [_prompts(builtin_examples(task, n=80, shard=s, n_shards=4, seed=s)) for s in range(4)]
    held = _prompts(builtin_examples(task, n=80, split="validation", seed=9))
    sets = shards + [held]
    assert all(len(s) == 80 for s in sets)
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            assert not sets[i] & sets[j], (i, j)


def test_arithmetic_is_two_digit_sums_and_nonnegative_differences():
    examples = builtin_examples("arithmetic", n=300, seed=1)
    ops = set()
    for ex in examples:
        m = _ARITH.fullmatch(ex["instruction"])
        assert m and ex["input"] == "", ex
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert ex["output"] == str(a + b if op == "+" else a - b) and int(ex["output"]) >= 0
        ops.add(op)
    assert ops == {"+", "-"}


def test_sort_words_answers_the_given_words_in_order():
    for ex in builtin_examples("sort_words", n=100, seed=2):
        given = ex["instruction"].split(": ", 1)[1].split(". ", 1)[0].split(", ")
        assert ex["output"] == ", ".join(sorted(given)) and len({w[0] for w in given}) == 3


@pytest.mark.parametrize("task", ["arithmetic-pairs", "sort_words-pairs"])
def test_pairs_reject_a_plausible_wrong_answer(task):
    pairs = builtin_examples(task, n=200, seed=3)
    source = builtin_examples(PAIR_TASKS[task], n=200, seed=3)
    assert [p["chosen"] for p in pairs] == [ex["output"] for ex in source]
    assert all(p["rejected"] != p["chosen"] for p in pairs)
    if task == "arithmetic-pairs":
        assert all(1 <= abs(int(p["rejected"]) - int(p["chosen"])) <= 3 and int(p["rejected"]) >= 0 for p in pairs)
    else:
        assert all(sorted(p["rejected"].split(", ")) == p["chosen"].split(", ") for p in pairs)


def test_prompt_only_records_carry_the_answer_the_reward_scores():
    records = prompt_only_records("arithmetic", n=20, shard=0, n_shards=2, split="train", seed=0)
    examples = builtin_examples("arithmetic", n=20, shard=0, n_shards=2, seed=0)
    assert records == [{"prompt": [{"role": "user", "content": ex["instruction"]}], "answer": ex["output"]}
                       for ex in examples]
    answers = [r["answer"] for r in records]
    right = [[{"role": "assistant", "content": f" {a}\n"}] for a in answers]
    wrong = [[{"role": "assistant", "content": str(int(a) + 1)}] for a in answers]
    assert exact_answer_reward(right, answer=answers) == [1.0] * 20
    assert exact_answer_reward(wrong, answer=answers) == [0.0] * 20
    assert format_reward(right) == [0.25] * 20
    with pytest.raises(ValueError, match="answer pairs"):
        prompt_only_records("arithmetic-pairs", n=2)


def test_builtin_task_per_stage_is_unchanged():
    assert [builtin_task(s) for s in ("sft", "dpo", "kto", "grpo", "rloo")] == \
        ["default", "preference", "preference", "grpo", "grpo"]


@pytest.mark.parametrize("task, stage, message", [
    ("nosuch", "sft", "got 'nosuch'"),
    ("arithmetic", "dpo", "stage dpo needs answer pairs"),
    ("arithmetic-pairs", "sft", "stage sft needs prompts with one answer"),
    ("sort_words-pairs", "grpo", "stage grpo needs prompts with one answer"),
])
def test_a_task_that_does_not_fit_the_stage_is_refused(task, stage, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_task_stage(task, stage)


@pytest.mark.parametrize("task, stage", [("arithmetic", "sft"), ("sort_words", "grpo"),
                                         ("arithmetic-pairs", "dpo"), ("preference", "kto")])
def test_a_task_that_fits_the_stage_passes(task, stage):
    check_task_stage(task, stage)


@pytest.mark.parametrize("args, message", [
    (["--task", "nosuch"], "--task: `task` must be one of"),
    (["--task", "arithmetic", "--stage", "dpo"], "stage dpo needs answer pairs"),
    (["--task", "arithmetic"], "too few distinct prompts"),  # 64 shards of ~160 prompts, 256 wanted
])
def test_join_refuses_a_bad_task_in_one_line_before_the_network(tmp_path, no_network, args, message):
    res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), *args])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_join_dry_run_accepts_a_fitting_task(tmp_path):
    res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), "--dry-run",
                                   "--task", "arithmetic-pairs", "--stage", "dpo", "--n-shards", "8"])
    assert res.exit_code == 0, res.output
