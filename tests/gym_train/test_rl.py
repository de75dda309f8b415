"""The RL stages on the tiny model: rloo (TRL RLOOTrainer), gspo, grpo loss types, contributors' own rewards
(functions and a local reward model)."""

import dataclasses
import json
import re
import textwrap

import pytest
import torch

from zoo_gym import codec
from zoo_gym.codec import LoraFactors
from zoo_gym.gym_train import TrainConfig, TrainConfigError, builtin_examples, tiny_model_dir, train
from zoo_gym.gym_train import grpo
from zoo_gym.gym_train.config import GRPO_LOSS_TYPES
from zoo_gym.evaluation.evaluate import load_tokenizer
from zoo_gym.gym_train.reward_model import RewardModel, RewardModelError
from zoo_gym.gym_train.rewards_loader import RewardFuncError, check_reward_funcs

pytestmark = pytest.mark.slow
BASE = tiny_model_dir()
RL = dict(max_steps=1, batch_size=8, num_generations=4, max_completion_length=4, grpo_eval_prompts=4, warmup_steps=0)


@pytest.fixture(scope="module")
def data():
    return builtin_examples("grpo", n=32), builtin_examples("grpo", split="validation", n=4)


@pytest.fixture
def used_args(monkeypatch):
    """The TRL config each RL round was built with."""
    seen = []

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    real = grpo.rl_args
    monkeypatch.setattr(grpo, "rl_args", spy)
    return seen


def _reward_file(tmp_path, body: str, name="reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_rloo_raises_the_heldout_reward_and_its_delta_survives_bitdelta(data, used_args, tmp_path):
    from trl import RLOOConfig

    # a verifiable reward the tiny model can earn fast: characters generated (it often stops after 1-2 digits).
    # 4 prompts x 4 completions a step, 4 steps at lr 1e-2: greedy held-out length went 2.09 -> 4.0 (the
    # 4-token cap) for each of seeds 0-7 here; with 2 prompts a step one seed in four collapsed instead
    path = _reward_file(tmp_path, """
        def longer(completions, **kwargs):
            return [float(len(c[-1]["content"])) for c in completions]
        """)
    cfg = TrainConfig(stage="rloo", reward_funcs=f"{path}:longer",
                      **{**RL, "max_steps": 4, "batch_size": 16, "learning_rate": 1e-2, "grpo_eval_prompts": 32})
    held = builtin_examples("grpo", split="validation", n=32)
    r = train(BASE, data[0], cfg, base_sha256="r", eval_examples=held)
    m = r.metadata
    assert (m["stage"], m["rl_trainer"], m["steps"], m["loss_type"]) == ("rloo", "RLOOTrainer", 4, None)
    assert type(used_args[0]) is RLOOConfig and used_args[0].beta == 0.05  # TRL's default KL
    assert m["heldout_examples"] == 32
    assert m["reward_after"] >= m["reward_before"] + 1.0  # mean greedy characters on unseen prompts
    assert all(isinstance(v, LoraFactors) for v in r.delta.values())
    decoded = codec.decode(codec.encode(r.delta, codec="bitdelta", group_size=-1))
    assert set(decoded) == set(r.delta)
    moved = 0
    for k, f in r.delta.items():
        dense = f.merged()
        assert decoded[k].shape == dense.shape
        nz = dense != 0
        moved += int(nz.sum())
        assert torch.equal(torch.sign(decoded[k][nz]), torch.sign(dense[nz]))  # 1 bit: the sign of each weight
    assert moved > 0


@pytest.mark.parametrize("stage,loss_type,level,used", [("gspo", None, "sequence", "grpo"),
                                                        ("grpo", "dr_grpo", "token", "dr_grpo")])
def test_gspo_and_grpo_loss_types_reach_trl(data, used_args, stage, loss_type, level, used):
    r = train(BASE, data[0], TrainConfig(stage=stage, loss_type=loss_type, **RL), base_sha256="g",
              eval_examples=data[1])
    args = used_args[0]
    assert (args.importance_sampling_level, args.loss_type, args.beta) == (level, used, 0.0)
    m = r.metadata
    assert (m["importance_sampling_level"], m["loss_type"], m["rl_trainer"], m["steps"]) == (level, used,
                                                                                              "GRPOTrainer", 1)


def test_a_contributors_reward_is_called_as_trl_calls_it_and_logged(data, tmp_path):
    log = tmp_path / "calls.jsonl"
    path = _reward_file(tmp_path, f"""
        import json

        def half(completions, answer, **kwargs):
            with open({str(log)!r}, "a") as f:
                f.write(json.dumps({{"n": len(completions), "keys": sorted(kwargs), "answer": answer[0],
                                     "completion": completions[0]}}) + "\\n")
            return [0.5] * len(completions)
        """)
    cfg = TrainConfig(stage="grpo", reward_funcs=f"{path}:half", reward_weights="2", **RL)
    r = train(BASE, data[0], cfg, base_sha256="c", eval_examples=data[1])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    trial, during = calls[0], calls[1:]
    assert trial["n"] == 2  # tried once before training
    trained = [c for c in during if c["n"] == 8]  # one call per batch of prompts x generations
    assert len(trained) == 1
    assert {"prompts", "completion_ids", "trainer_state"} <= set(trained[0]["keys"])
    assert trained[0]["completion"][-1]["role"] == "assistant"  # conversational, as TRL passes them
    m = r.metadata
    assert m["reward_funcs"] == ["half"] and m["reward_weights"] == [2.0]
    assert m["train_reward_first"] == pytest.approx(1.0)  # TRL's logged reward: 2 x 0.5
    assert m["reward_before"] == pytest.approx(1.0) and m["reward_after"] == pytest.approx(1.0)


def test_a_module_reward_spec_loads():
    funcs = check_reward_funcs(TrainConfig(stage="grpo", reward_funcs="zoo_gym.gym_train.grpo:format_reward"))
    assert funcs == [grpo.format_reward]
    assert check_reward_funcs(TrainConfig(stage="grpo")) is None  # the built-ins


BAD = {
    "missing.py:f": "file not found",
    "reward.py:nope": "has no 'nope'",
    "reward.py:NUMBER": "'NUMBER' is a int, not a function",
    "reward.py:no_kwargs": "no \\*\\*kwargs",
    "reward.py:extra_param": "parameter 'weight' is not one TRL fills",
    "reward.py:short": "returned 1 values for 2 completions",
    "reward.py:text": "must return a list of floats, got str",
    "reward.py:strings": "must return floats \\(or None\\), got 'a'",
    "reward.py:boom": "failed on a sample of 2 completions: KeyError",
    "no_such_module_zz:f": "cannot import module 'no_such_module_zz'",
}


@pytest.mark.parametrize("spec,message", BAD.items())
def test_a_bad_reward_fails_in_one_line_before_training(data, tmp_path, monkeypatch, spec, message):
    _reward_file(tmp_path, """
        NUMBER = 3
        def no_kwargs(completions): return [0.0] * len(completions)
        def extra_param(completions, weight, **kw): return [0.0] * len(completions)
        def short(completions, **kw): return [0.0]
        def text(completions, **kw): return "0.0"
        def strings(completions, **kw): return ["a"] * len(completions)
        def boom(completions, **kw): return {}["x"]
        """)
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(stage="rloo", reward_funcs=spec, **RL)
    monkeypatch.setattr(grpo, "load_training_model", lambda *a, **k: pytest.fail("trained with a bad reward"))
    with pytest.raises(RewardFuncError, match=message) as info:
        train(BASE, data[0], cfg, base_sha256="b")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"reward_funcs {spec!r}")


def test_the_client_refuses_a_bad_reward_before_contacting_a_server(tmp_path):
    from zoo_gym.client.contribute import JoinError
    from zoo_gym.client.join import JoinOptions, prepare

    opts = JoinOptions(server="127.0.0.1:1", workdir=tmp_path, key_path=tmp_path / "key",
                       train_overrides={"stage": "grpo", "reward_funcs": f"{tmp_path}/gone.py:f"})
    with pytest.raises(JoinError, match="file not found"):
        prepare(opts)


def test_loss_type_and_stage_refusals_name_the_allowed_values(tmp_path):
    with pytest.raises(TrainConfigError, match=r"`loss_type` for grpo must be one of grpo, dr_grpo, dapo, bnpo"):
        TrainConfig(stage="grpo", loss_type="sigmoid")
    with pytest.raises(TrainConfigError, match=r"`loss_type` is not used by rloo"):
        TrainConfig(stage="rloo", loss_type="dapo")
    with pytest.raises(TrainConfigError, match=r"`stage` .*ppo is not offered: TRL 1.16 ships no PPO trainer"):
        TrainConfig(stage="ppo")
    with pytest.raises(TrainConfigError, match=r"`reward_weights` needs one weight per reward function \(2\)"):
        TrainConfig(stage="grpo", reward_weights="1")
    with pytest.raises(TrainConfigError, match=r"`reward_funcs` entry 'r.py' must be path/to/file.py:name"):
        TrainConfig(stage="rloo", reward_funcs="r.py")
    assert TrainConfig(stage="gspo", loss_type="luspo").importance_sampling_level == "sequence"
    grpo_sequence = TrainConfig(stage="grpo", importance_sampling_level="sequence", batch_size=8, num_generations=4)
    assert grpo.rl_args(grpo_sequence, str(tmp_path), progress=False, weights=None).importance_sampling_level == "sequence"


def test_grpo_loss_types_are_the_ones_trl_documents():
    from trl import GRPOConfig

    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    documented = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert tuple(re.findall(r"'(\w+)'", documented)) == GRPO_LOSS_TYPES


def _save_reward_model(out, *, num_labels=1, weights=True, chat_template=True):
    """A random tiny sequence-classification model on the tiny base's config, saved with its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(BASE, num_labels=num_labels))
    model.save_pretrained(out)
    tokenizer = load_tokenizer(BASE)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    if not weights:
        (out / "model.safetensors").unlink()
    if not chat_template:
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return _save_reward_model(tmp_path_factory.mktemp("rm"))


def test_a_local_reward_model_alone_trains_rloo(data, reward_model_dir, used_args):
    r = train(BASE, data[0], TrainConfig(stage="rloo", reward_model=str(reward_model_dir), **RL), base_sha256="m",
              eval_examples=data[1])
    m = r.metadata
    assert (m["steps"], m["reward_funcs"], m["reward_model"]) == (1, ["reward_model"], "Qwen3ForSequenceClassification")
    assert m["train_reward_first"] not in (None, 0.0) and m["reward_before"] not in (None, 0.0)  # random scores
    assert any(f.merged().abs().sum() > 0 for f in r.delta.values())


def test_a_reward_model_after_a_function_is_scored_as_trl_scores_it(data, reward_model_dir, tmp_path):
    # the function sees TRL's completions and gives 0; the logged reward is then the reward model's mean on them,
    # which the held-out measure's scorer (RewardModel.__call__) must reproduce
    log = tmp_path / "seen.jsonl"
    path = _reward_file(tmp_path, f"""
        import json

        def zero(prompts, completions, **kwargs):
            with open({str(log)!r}, "a") as f:
                f.write(json.dumps({{"prompts": prompts, "completions": completions}}) + "\\n")
            return [0.0] * len(completions)
        """)
    cfg = TrainConfig(stage="grpo", reward_funcs=f"{path}:zero", reward_model=str(reward_model_dir),
                      reward_weights="1,1", **RL)
    m = train(BASE, data[0], cfg, base_sha256="m", eval_examples=data[1]).metadata
    assert m["reward_funcs"] == ["zero", "reward_model"] and m["reward_weights"] == [1.0, 1.0]
    calls = [json.loads(line) for line in log.read_text().splitlines()]  # trial, held-out, training, held-out
    [step] = [c for c in calls if len(c["completions"]) == RL["batch_size"]]
    scores = RewardModel(reward_model_dir)(step["prompts"], step["completions"])
    assert m["train_reward_first"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


BAD_MODELS = {
    "missing": "not a local directory .*nothing is downloaded",
    "causal_lm": "is a Qwen3ForCausalLM checkpoint, not a reward model",
    "two_labels": "has 2 labels; a reward model has one",
    "no_weights": "holds no weights",
    "no_template": "its tokenizer has no chat template",
}


@pytest.mark.parametrize("case,message", BAD_MODELS.items())
def test_a_bad_reward_model_fails_in_one_line_before_training(data, tmp_path, monkeypatch, case, message):
    path = {"missing": tmp_path / "gone", "causal_lm": BASE}.get(case) or _save_reward_model(
        tmp_path / case, num_labels=2 if case == "two_labels" else 1, weights=case != "no_weights",
        chat_template=case != "no_template")
    monkeypatch.setattr(grpo, "load_training_model", lambda *a, **k: pytest.fail("trained with a bad reward model"))
    with pytest.raises(RewardModelError, match=message) as info:
        train(BASE, data[0], TrainConfig(stage="gspo", reward_model=str(path), **RL), base_sha256="b")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"reward_model {str(path)!r}: ")


def test_the_client_checks_the_reward_model_before_contacting_a_server(tmp_path, reward_model_dir):
    from typer.testing import CliRunner

    from zoo_gym.client.cli import app

    def dry_run(*args):
        res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path / "home"),
                                       "--key", str(tmp_path / "key.pem"), "--dry-run", "--stage", "rloo", *args])
        return res.exit_code, res.stdout, res.stderr.strip()

    code, _, err = dry_run("--reward-model", str(tmp_path / "gone"))
    assert code != 0 and "\n" not in err and "not a local directory" in err
    code, out, _ = dry_run("--reward-model", str(reward_model_dir), "--reward-weights", "2")
    assert code == 0 and json.loads(out)["training"]["reward_model"] == str(reward_model_dir)
    with pytest.raises(TrainConfigError, match=r"one weight per reward function \(2, the reward model last\)"):
        TrainConfig(stage="grpo", reward_funcs="zoo_gym.gym_train.grpo:format_reward",
                    reward_model=str(reward_model_dir), reward_weights="1")
