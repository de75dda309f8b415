"""Preference stages (dpo, kto, orpo, simpo) on built-in pairs, and the preference data formats."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from zoo_gym.codec import LoraFactors, decode, encode
from zoo_gym.gym_train import (DataError, TrainConfig, TrainConfigError, builtin_examples, load_examples,
                               tiny_model_dir, train)
from zoo_gym.gym_train.formats import check_stage_data, split_shared_prompt

BASE = tiny_model_dir()


def _base_shapes():
    with safe_open(str(BASE / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(scope="module")
def pairs():
    return builtin_examples("preference", n=24, seed=1), builtin_examples("preference", split="validation", n=12)


@pytest.mark.slow
@pytest.mark.parametrize("stage, finetuning_type, loss_type", [
    ("dpo", "lora", None),  # sigmoid, TRL's default
    ("dpo", "lora", "ipo"),
    ("dpo", "full", "sigmoid"),
    ("kto", "lora", None),
    ("orpo", "lora", None),
    ("simpo", "lora", None),
])
def test_stage_trains_and_prefers_the_chosen_answers_more(pairs, stage, finetuning_type, loss_type):
    ex, held = pairs
    cfg = TrainConfig(stage=stage, finetuning_type=finetuning_type, loss_type=loss_type, max_steps=4, batch_size=4,
                      warmup_steps=0, learning_rate=3e-3 if finetuning_type == "lora" else 1e-3, max_length=48,
                      device="cpu")
    r = train(BASE, ex, cfg, base_sha256="ab" * 32, eval_examples=held)
    m = r.metadata
    assert (m["stage"], m["finetuning_type"], m["steps"], m["loss_type"]) == (stage, finetuning_type, 4, loss_type)
    assert m["preference_pairs"] == len(held)
    assert m["preference_margin_after"] > m["preference_margin_before"]
    assert m["preference_accuracy_after"] >= m["preference_accuracy_before"]
    shapes = _base_shapes()
    dense = {k: v.merged() if isinstance(v, LoraFactors) else v for k, v in r.delta.items()}
    assert set(dense) <= set(shapes) and all(tuple(v.shape) == shapes[k] for k, v in dense.items())
    if finetuning_type == "lora":
        assert m["delta_format"] == "lora_factors" and len(dense) == 28
    else:
        assert m["delta_format"] == "dense" and set(dense) == set(shapes)
    back = decode(encode(dense, codec="bitdelta", group_size=128))
    assert set(back) == set(dense)
    for k, v in dense.items():
        assert back[k].shape == v.shape and torch.isfinite(back[k]).all()
        assert torch.equal(torch.sign(back[k])[v != 0], torch.sign(v)[v != 0])  # 1-bit signs survive


def test_builtin_pairs_follow_the_default_task_shards():
    base = builtin_examples("default", shard=2, n_shards=5, n=30, seed=3)
    got = builtin_examples("preference", shard=2, n_shards=5, n=30, seed=3)
    assert [(p["instruction"], p["input"], p["chosen"]) for p in got] == [
        (e["instruction"], e["input"], e["output"]) for e in base]
    assert all(p["rejected"] != p["chosen"] and len(p["rejected"]) == len(p["chosen"]) for p in got)
    assert got == builtin_examples("preference", shard=2, n_shards=5, n=30, seed=3)


_PAIR = {"instruction": "Say hi.", "input": "", "chosen": "hi", "rejected": "bye"}


def _chat(*turns):
    """Messages alternating user and assistant from the first; a leading ("system", text) is a system turn."""
    roles = iter(("user", "assistant") * len(turns))
    return [{"role": t[0], "content": t[1]} if isinstance(t, tuple) else {"role": next(roles), "content": t}
            for t in turns]


# TRL's implicit prompt: `chosen` and `rejected` hold the whole conversation (or text); the prompt is their
# shared beginning
IMPLICIT = [
    ({"chosen": _chat("Say hi.", "hi"), "rejected": _chat("Say hi.", "bye")}, _PAIR),
    ({"chosen": _chat(("system", "Be kind."), "a", "b", "Say hi.", "hi"),
      "rejected": _chat(("system", "Be kind."), "a", "b", "Say hi.", "bye")},
     {**_PAIR, "system": "Be kind.", "history": [["a", "b"]]}),
    ({"chosen": "Say hi. hi", "rejected": "Say hi. bye"}, {**_PAIR, "chosen": " hi", "rejected": " bye"}),
    # a text prompt beside whole conversations is set aside, as trl.maybe_extract_prompt does
    ({"prompt": "Say hi.", "chosen": _chat("Say hi.", "hi"), "rejected": _chat("Say hi.", "bye")}, _PAIR),
]


@pytest.mark.parametrize("record, expected", [
    ({"prompt": "Say hi.", "chosen": "hi", "rejected": "bye"}, _PAIR),
    ({"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hi."}],
      "chosen": [{"role": "assistant", "content": "hi"}], "rejected": [{"role": "assistant", "content": "bye"}]},
     {**_PAIR, "system": "Be kind."}),
    ({"conversations": [{"from": "human", "value": "Say hi."}], "chosen": {"from": "gpt", "value": "hi"},
      "rejected": {"from": "gpt", "value": "bye"}}, _PAIR),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "Say hi."}],
      "chosen": {"role": "assistant", "content": "hi"}, "rejected": {"role": "assistant", "content": "bye"}},
     {**_PAIR, "history": [["a", "b"]]}),
    ({"instruction": "Say", "input": "hi.", "chosen": "hi", "rejected": "bye"},
     {**_PAIR, "instruction": "Say", "input": "hi."}),
    ({"prompt": "Say hi.", "completion": "bye", "label": False},
     {"instruction": "Say hi.", "input": "", "output": "bye", "label": False}),
    ({"prompt": [{"role": "user", "content": "Say hi."}], "completion": [{"role": "assistant", "content": "hi"}],
      "label": True}, {"instruction": "Say hi.", "input": "", "output": "hi", "label": True}),
    ({"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}], "kto_tag": True},
     {"instruction": "Say hi.", "input": "", "output": "hi", "label": True}),
    *IMPLICIT,
])
def test_each_preference_format_loads(tmp_path, record, expected):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(record) + "\n")
    assert load_examples(p) == [expected]


@pytest.mark.parametrize("record, field", [
    ({"prompt": "q", "chosen": "a"}, "rejected"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, "rejected"),
    ({"prompt": "q", "chosen": " ", "rejected": "b"}, "chosen"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "rejected"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": "b"}, "chosen"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}],
      "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}, "conversations[1].from"),
    ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "human", "value": "a"},
      "rejected": {"from": "gpt", "value": "b"}}, "chosen.from"),
    ({"input": "x", "chosen": "a", "rejected": "b"}, "instruction"),
    ({"chosen": _chat("q", "a"), "rejected": _chat("another q", "b")}, "prompt"),  # no shared prompt
    ({"chosen": "yes", "rejected": "no"}, "prompt"),
    ({"chosen": "q? yes", "rejected": _chat("q?", "no")}, "rejected"),
    ({"chosen": _chat("q", "x", "y", "a"), "rejected": _chat("q", "x", "z", "b")}, "chosen"),  # two turns left
    ({"chosen": _chat("q", "a") + [{"role": "user", "content": "more"}], "rejected": _chat("q", "b")}, "chosen"),
    ({"chosen": _chat("q", "a"), "rejected": _chat("q") + [{"role": "user", "content": "b"}]}, "rejected[1].role"),
    ({"chosen": _chat("q", "a"), "rejected": _chat("q", "a")}, "rejected"),  # the same answer
    ({"prompt": "q", "completion": "c", "label": "yes"}, "label"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"}], "kto_tag": 1},
     "kto_tag"),
])
def test_bad_preference_records_name_file_row_and_field(tmp_path, record, field):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "ok", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        load_examples(p)
    assert (e.value.file, e.value.where, e.value.field) == (str(p), "line 2", field)


@pytest.mark.parametrize("record", [r for r, _ in IMPLICIT[:3]])
def test_the_implicit_prompt_is_split_where_trl_splits_it(record):
    from trl import extract_prompt

    want = extract_prompt(record)
    assert split_shared_prompt(record["chosen"], record["rejected"]) == (want["prompt"], want["chosen"],
                                                                        want["rejected"])


_ANSWERS = [{"instruction": "q", "input": "", "output": "a"}] * 4
_LABELLED = [{"instruction": "q", "input": "", "output": "a", "label": True},
             {"instruction": "q", "input": "", "output": "b", "label": False}] * 2
_PAIRS = [dict(_PAIR)] * 4


@pytest.mark.parametrize("stage, examples, needs", [
    ("dpo", _ANSWERS, "`chosen` and `rejected`"),
    ("orpo", _LABELLED, "use --stage kto"),
    ("simpo", _ANSWERS, "`chosen` and `rejected`"),
    ("kto", _ANSWERS, "boolean `label`"),
    ("kto", _LABELLED[:1] * 4, "both desirable"),
    ("sft", _PAIRS, "one answer per prompt"),
    ("grpo", _LABELLED, "one answer per prompt"),
])
def test_a_stage_without_the_data_it_needs_is_refused_in_one_line(stage, examples, needs):
    with pytest.raises(ValueError, match=f"stage '{stage}'") as e:
        train(BASE, examples, TrainConfig(stage=stage, max_steps=1, batch_size=8), base_sha256="ab" * 32)
    assert needs in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("stage, examples", [("dpo", _PAIRS), ("kto", _PAIRS), ("kto", _LABELLED),
                                             ("sft", _ANSWERS)])
def test_the_data_a_stage_can_train_on_passes(stage, examples):
    check_stage_data(stage, examples)


@pytest.mark.parametrize("stage, loss_type", [("dpo", "nope"), ("dpo", "sigmoid,nope"), ("kto", "sigmoid"),
                                              ("orpo", "sigmoid"), ("simpo", "ipo")])
def test_a_loss_type_the_stage_lacks_is_refused_naming_the_allowed_ones(stage, loss_type):
    with pytest.raises(TrainConfigError, match="`loss_type` must") as e:
        TrainConfig(stage=stage, loss_type=loss_type)
    assert "\n" not in str(e.value)


def test_join_refuses_a_stage_without_its_data_before_contacting_a_server(tmp_path):
    from zoo_gym.client.contribute import JoinError
    from zoo_gym.client.join import JoinOptions, dry_run, prepare

    p = tmp_path / "answers.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _ANSWERS * 2))
    opts = JoinOptions(server="127.0.0.1:1", workdir=tmp_path, key_path=tmp_path / "key", data=str(p),
                       train_overrides={"stage": "dpo"})
    with pytest.raises(JoinError, match="stage 'dpo' needs preference pairs"):
        prepare(opts)
    q = tmp_path / "pairs.jsonl"
    q.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(8)))
    config, examples = prepare(dataclasses.replace(opts, data=str(q)))
    assert config.stage == "dpo" and examples[0] == {"instruction": "q0", "input": "", "chosen": "a", "rejected": "b"}
    implicit = tmp_path / "implicit.jsonl"  # TRL's implicit prompt: whole conversations in chosen and rejected
    implicit.write_text("".join(json.dumps({"chosen": _chat(f"q{i}", "a"), "rejected": _chat(f"q{i}", "b")}) + "\n"
                                for i in range(8)))
    doc = dry_run(dataclasses.replace(opts, data=str(implicit)))
    assert doc["training"]["stage"] == "dpo" and doc["data"]["format"] == "preference pairs"
    assert doc["data"]["examples"] == 8
