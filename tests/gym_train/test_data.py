"""Built-in data, user data formats, the shipped tiny model and its deterministic recipe."""

import hashlib
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.gym_train import (DataError, builtin_examples, default_validation_examples, load_examples,
                               tiny_model_dir)
from zoo_gym.evaluation.chat import render_completion, render_prompt
from zoo_gym.gym_train.make_tiny import TinySpec, build_config, build_tokenizer, pretrain


def _key(ex):
    return (ex["instruction"], ex["input"])


@settings(max_examples=15, deadline=None)
@given(n_shards=st.integers(1, 5), seed_a=st.integers(0, 3), seed_b=st.integers(0, 3),
       task=st.sampled_from(["default", "word_math", "arith"]))
def test_shards_are_disjoint_from_each_other_and_from_validation(n_shards, seed_a, seed_b, task):
    val = {_key(e) for e in builtin_examples(task, split="validation", n=100, seed=seed_a)}
    shards = [{_key(e) for e in builtin_examples(task, shard=s, n_shards=n_shards, n=60, seed=seed_b)}
              for s in range(n_shards)]
    for i, a in enumerate(shards):
        assert len(a) == 60 and not (a & val)
        for b in shards[i + 1:]:
            assert not (a & b)


def test_builtin_examples_are_deterministic_and_correct():
    a = builtin_examples("default", shard=1, n_shards=3, n=50, seed=7)
    assert a == builtin_examples("default", shard=1, n_shards=3, n=50, seed=7)
    assert a != builtin_examples("default", shard=1, n_shards=3, n=50, seed=8)
    for ex in a:
        assert ex["instruction"] == "Reverse the digits." and ex["output"] == ex["input"][::-1]
    for ex in builtin_examples("word_math", n=50):
        a_, b_ = [int(t) for t in re.findall(r"\d+", ex["input"])]
        assert int(ex["output"]) == (a_ + b_ if "gets" in ex["input"] else a_ - b_)
    assert default_validation_examples(16) == builtin_examples("default", split="validation", n=16)
    with pytest.raises(ValueError, match="`shard`"):
        builtin_examples(shard=3, n_shards=3)
    with pytest.raises(ValueError, match="`task`"):
        builtin_examples("nope")


def test_tiny_model_loads_with_auto_classes_and_digits_are_single_tokens():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_model_dir()
    total = sum(f.stat().st_size for f in d.iterdir())
    assert total < 5 * 2**20
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.model_type == "qwen3" and model.dtype == torch.float32
    ids = tok("x 1234567890 y", add_special_tokens=False)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert [t for t in toks if any(c.isdigit() for c in t)] == list("1234567890")
    ex = {"instruction": "Compute.", "input": "2+3", "output": "5"}
    chat = tok.apply_chat_template([{"role": "user", "content": "Compute.\n2+3"},
                                    {"role": "assistant", "content": "5"}], tokenize=False)
    assert chat == render_prompt(ex) + render_completion(ex)
    # the base knows the pretraining format: greedy answer to a copy task is exact
    tok.padding_side = "left"
    enc = tok([render_prompt({"instruction": "Repeat the digits.", "input": "40213"})], return_tensors="pt",
              add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True) == "40213"


def test_tokenizer_and_config_regenerate_identically(tmp_path):
    d = tiny_model_dir()
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / f).read_bytes() == (d / f).read_bytes(), f
    cfg = build_config(tok)
    shipped = json.loads((d / "config.json").read_text())
    assert cfg.to_dict()["vocab_size"] == shipped["vocab_size"]
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    # every field the same; `transformers_version` names whichever release wrote the file (5.23.0 shipped it,
    # a fresh install takes the newest 5.x), which is not the model's content
    ours, theirs = (json.loads((p / "config.json").read_text()) for p in (tmp_path, d))
    assert ours.pop("transformers_version") and theirs.pop("transformers_version")
    assert ours == theirs


def test_pretraining_is_deterministic_on_a_few_steps():
    from transformers import AutoModelForCausalLM

    spec = TinySpec(batch_size=8)
    tok = build_tokenizer(spec)
    digests = []
    for _ in range(2):
        torch.manual_seed(spec.seed)
        m = AutoModelForCausalLM.from_config(build_config(tok, spec))
        pretrain(m, tok, spec, steps=3)
        h = hashlib.sha256()
        for k, v in sorted(m.state_dict().items()):
            h.update(k.encode() + v.numpy().tobytes())
        digests.append(h.hexdigest())
    assert digests[0] == digests[1]


def _write(path, text):
    path.write_text(text)
    return path


def test_load_alpaca_json_and_sharegpt_jsonl(tmp_path):
    a = _write(tmp_path / "a.json", json.dumps([{"instruction": "Say hi", "input": "", "output": "hi"},
                                                {"instruction": "Add", "input": "1+1", "output": "2",
                                                 "system": "be brief"}]))
    assert load_examples(a) == [{"instruction": "Say hi", "input": "", "output": "hi"},
                                {"instruction": "Add", "input": "1+1", "output": "2", "system": "be brief"}]
    s = _write(tmp_path / "s.jsonl", "\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
                           {"from": "gpt", "value": "a2"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]))
    assert load_examples(s) == [
        {"instruction": "q2", "input": "", "output": "a2", "system": "sys", "history": [["q1", "a1"]]},
        {"instruction": "q", "input": "", "output": "a"},
    ]


@pytest.mark.parametrize("name,text,where,field", [
    ("bad.jsonl", '{"instruction": "x", "output": "y"}\n{"instruction": "x"}\n', "line 2", "output"),
    ("bad2.jsonl", '{"instruction": "x", "output": "y"}\n\n{"instruction": "x", "output": 3}\n', "line 3", "output"),
    ("bad3.jsonl", '{"instruction": "x", "output": "y"}\n{oops\n', "line 2", "<json>"),
    ("bad4.json", '[{"instruction": "x", "output": "y"}, {"conversations": [{"from": "gpt", "value": "a"}]}]',
     "record 1", "conversations[0].from"),
    ("bad5.json", '[{"instruction": "", "output": "y"}]', "record 0", "instruction"),
    ("bad6.jsonl", '{"conversations": [{"from": "human", "value": "q"}]}\n', "line 1", "conversations"),
])
def test_malformed_records_are_refused_with_file_line_and_field(tmp_path, name, text, where, field):
    p = _write(tmp_path / name, text)
    with pytest.raises(DataError) as e:
        load_examples(p)
    assert e.value.where == where and e.value.field == field
    assert str(p) in str(e.value) and where in str(e.value) and repr(field) in str(e.value)
