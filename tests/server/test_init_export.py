"""gym-server init refuses unusable bases and data in one line; --validation-data; export and the model card
(issue 13 items 3, 4, 6)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zoo_gym.gym_train.families import make_random_base
from zoo_gym.server.cli import app
from zoo_gym.proto.model_card import model_card, round_summary
from zoo_gym.server.store.state import open_state
from zoo_gym.server.genesis import init_state


def _one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def test_validation_data_is_checked_copied_and_used_by_serve(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x"}\n')
    res = CliRunner().invoke(app, ["init", "--state-dir", str(tmp_path / "a"), "--validation-data", str(bad)])
    assert "bad.jsonl" in _one_line_error(res)
    assert not (tmp_path / "a").exists()  # nothing created

    good = tmp_path / "val.jsonl"
    good.write_text("".join(json.dumps({"instruction": "Add.", "input": f"{i}+1", "output": str(i + 1)}) + "\n"
                            for i in range(4)))
    res = CliRunner().invoke(app, ["init", "--state-dir", str(tmp_path / "b"), "--validation-data", str(good)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "b" / "state.json").read_text())["validation_file"] == "validation.jsonl"
    good.unlink()  # the state directory keeps its own copy
    state = open_state(tmp_path / "b")
    assert state.validation_file == tmp_path / "b" / "validation.jsonl" and state.validation_file.is_file()
    state.engine.dispose()


def test_serve_refuses_a_validation_file_that_does_not_load(tmp_path):
    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path / "none"), "--validation-data",
                                   str(tmp_path / "missing.jsonl")])
    assert "missing.jsonl" in _one_line_error(res)


def test_help_documents_the_flags():
    for cmd in ("init", "serve"):
        out = CliRunner().invoke(app, [cmd, "--help"]).output
        assert "--validation-data" in out and "sharegpt" in out and ".jsonl" in out
    assert "--chat-template" in CliRunner().invoke(app, ["init", "--help"]).output


def test_a_base_whose_vocabulary_is_too_small_is_refused_before_anything_is_created(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = make_random_base("llama", tmp_path / "base")
    cfg = AutoConfig.from_pretrained(base)
    cfg.vocab_size = 16  # the tokenizer's ids run past the embedding table
    AutoModelForCausalLM.from_config(cfg).save_pretrained(base)
    res = CliRunner().invoke(app, ["init", "--state-dir", str(tmp_path / "s"), "--base-model", str(base)])
    assert "only 16 embeddings" in _one_line_error(res)
    assert not (tmp_path / "s").exists()


def test_a_chat_template_without_the_answer_is_refused(tmp_path):
    base = make_random_base("qwen3", tmp_path / "base")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    res = CliRunner().invoke(app, ["init", "--state-dir", str(tmp_path / "s"), "--base-model", str(base),
                                   "--chat-template", str(tpl)])
    assert "chat template" in _one_line_error(res)
    assert not (tmp_path / "s").exists()


def test_an_operator_template_is_written_into_the_genesis(tmp_path):
    from zoo_gym.evaluation.evaluate import load_tokenizer

    base = make_random_base("qwen3", tmp_path / "base", chat_template=False)
    tpl = tmp_path / "t.jinja"
    text = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    tpl.write_text(text)
    state = init_state(tmp_path / "s", base_model=str(base), chat_template=tpl)
    with state.session() as s:
        sha = state.current_round(s).base_sha256
    assert load_tokenizer(state.checkpoint_dir(sha)).chat_template == text
    assert json.loads((tmp_path / "s" / "state.json").read_text())["chat_template"] == "--chat-template"
    state.engine.dispose()


def test_export_refuses_a_non_empty_target_and_unknown_rounds_and_exports_the_genesis(tmp_path):
    from transformers import AutoModelForCausalLM

    init_state(tmp_path / "s").engine.dispose()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    runner = CliRunner()
    assert "not an empty directory" in _one_line_error(runner.invoke(app, ["export", "--state-dir", str(tmp_path / "s"),
                                                                           str(tmp_path / "full")]))
    assert "round 7" in _one_line_error(runner.invoke(app, ["export", "--state-dir", str(tmp_path / "s"),
                                                            "--round", "7", str(tmp_path / "o")]))
    res = runner.invoke(app, ["export", "--state-dir", str(tmp_path / "s"), str(tmp_path / "o")])
    assert res.exit_code == 0 and "exported round 0" in res.output
    AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    card = (tmp_path / "o" / "README.md").read_text()
    assert "base_model" not in card.split("---")[1] and "`tiny`" in card and "rounds: 0" in card


def test_model_card_from_manifests():
    genesis = round_summary({"round": 0, "base_model": "Qwen/Qwen3-0.6B"}, sha256="a" * 64, heldout_loss=5.5)
    r1 = round_summary({"round": 1, "parent_sha256": "a" * 64, "contributors": ["c1", "c2", "c3"],
                        "accepted": ["c1", "c2"], "aggregator": "trust-mean",
                        "privacy": {"epsilon_round": 0.5, "epsilon_total": 0.5, "delta": 1e-5,
                                    "mechanism": "trust-mean / fixed m=3", "participation": "public"},
                        "submissions": [{"contributor": "c1", "method": "lora"}, {"contributor": "c2", "method": "sft"}]},
                       sha256="b" * 64, heldout_loss=2.25)
    r2 = round_summary({"round": 2, "parent_sha256": "b" * 64, "contributors": ["c1", "c4"], "accepted": ["c1", "c4"],
                        "aggregator": "trust-mean", "privacy": {"epsilon_round": 0.5, "epsilon_total": 0.8,
                                                               "delta": 1e-5, "mechanism": "trust-mean / fixed m=3",
                                                               "participation": "public"}, "heldout_loss": 2.0},
                       sha256="c" * 64)
    card = model_card([r2, genesis, r1], base_model="Qwen/Qwen3-0.6B")
    head = card.split("---")[1]
    assert "base_model: Qwen/Qwen3-0.6B" in head and "library_name: transformers" in head
    assert "- differential-privacy" in head and "- lora" in head and "- sft" in head
    assert "rounds: 2; contributors: 4" in card
    assert "ε = 0.800 at δ = 1e-05 spent in total, for the published weights (trust-mean / fixed m=3; " in card
    assert "not whether it took part; per-contributor scores and pay are outside it and shown to their owner only)" in card
    assert "| 1 | `bbbbbbbbbbbb` | `aaaaaaaaaaaa` | 3 | 2 | trust-mean | 0.500 | 0.500 | 2.2500 |" in card
    assert card.index("| 0 |") < card.index("| 1 |") < card.index("| 2 |")
    with pytest.raises(ValueError):
        model_card([], base_model="x")


def test_a_card_claims_no_privacy_for_a_round_whose_rule_the_noise_did_not_bound():
    """Before issue 46 a server ran robust rules with the mean's noise and recorded the mean's ε for them
    (`covers_aggregator` false): a card must not turn that figure into a claim."""
    genesis = round_summary({"round": 0, "base_model": "tiny"}, sha256="a" * 64)
    old = round_summary({"round": 1, "parent_sha256": "a" * 64, "contributors": ["c1"], "accepted": ["c1"],
                         "aggregator": "trimmed-mean", "privacy": {"epsilon_round": 4.4, "epsilon_total": 4.4,
                                                                  "delta": 1e-5, "covers_aggregator": False}},
                        sha256="b" * 64)
    card = model_card([genesis, old], base_model="tiny")
    assert "differential-privacy" not in card.split("---")[1]
    assert "differential privacy: none claimed: round(s) 1 added noise" in card
