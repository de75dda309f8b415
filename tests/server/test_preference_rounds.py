"""Validation data with preference pairs: the published report carries preference accuracy and margin before
and after, and scoring pays the delta that raises the margin, not the one that lowers it nor a no-op."""

from __future__ import annotations

import json

import pytest

from zoo_gym import codec


def _validation_file(path):
    """16 pairs (the built-in task's answer over its reversal, which the tiny model prefers), half alpaca and
    half prompt/chosen/rejected records, and 8 plain records for the held-out loss."""
    from zoo_gym.gym_train import default_validation_examples

    ex = default_validation_examples(n=24)
    lines = []
    for i, e in enumerate(ex[:16]):
        wrong = e["output"][::-1] if e["output"][::-1] != e["output"] else e["output"] + "1"
        prompt = {"instruction": e["instruction"], "input": e.get("input", "")} if i % 2 else \
            {"prompt": e["instruction"] + ("\n\n" + e["input"] if e.get("input") else "")}
        lines.append({**prompt, "chosen": e["output"], "rejected": wrong})
    lines += [dict(e) for e in ex[16:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _preference_step(fed, names: int = 4) -> dict:
    """The unit descent direction of the pairs' Bradley-Terry loss at the current base, on a few matrices."""
    from zoo_gym.evaluation.evaluate import load_model, load_tokenizer
    from zoo_gym.evaluation.preference_scoring import PreferenceScoringSet
    from zoo_gym.gym_train.formats import load_validation

    ckpt = fed.state.checkpoint_dir(fed.round().base_sha256)
    pairs = [r for r in load_validation(fed.config.validation_data) if "chosen" in r]
    grad = PreferenceScoringSet(load_model(ckpt), load_tokenizer(ckpt), pairs).gradient().grad
    chosen = [k for k, t in grad.items() if t.dim() == 2 and "embed" not in k][:names]
    return {k: -grad[k] / grad[k].norm() for k in chosen}


def test_loader_reads_pairs_and_plain_records(tmp_path):
    from zoo_gym.evaluation.server_evaluator import loss_and_pairs
    from zoo_gym.gym_train.formats import load_validation

    recs = load_validation(_validation_file(tmp_path / "val.jsonl"))
    pairs, rest = loss_and_pairs(recs)
    assert len(pairs) == 16 and len(rest) == 8
    assert all(set(p) >= {"instruction", "chosen", "rejected"} and "output" not in p for p in pairs)
    only_pairs, chosen = loss_and_pairs(pairs)
    assert [c["output"] for c in chosen] == [p["chosen"] for p in only_pairs]


@pytest.mark.slow
def test_pairs_report_the_margin_and_pay_the_delta_that_raises_it(federation_with, tmp_path):
    from zoo_gym.server.rounds.settlement import balance_of
    from zoo_gym.server.store.models import Checkpoint

    val = _validation_file(tmp_path / "val.jsonl")
    fed = federation_with(min_contributors=3, aggregator="mean", validation_data=str(val),
                          validation_examples=24, reward_pool=1000)
    (kh, helpful), (kb, harmful), (kn, noop) = fed.register(), fed.register(), fed.register()
    step = _preference_step(fed)
    fed.submit(kh, helpful, codec.encode({k: 0.09 * v for k, v in step.items()}, codec="fp16"))
    fed.submit(kb, harmful, codec.encode({k: -0.03 * v for k, v in step.items()}, codec="fp16"))
    fed.submit(kn, noop, codec.encode(fed.small_delta(seed=3, scale=1e-7), codec="fp16"))
    rnd = fed.wait_published(1)

    report = json.loads(rnd.report_json)
    pref = report["preference"]
    for when in ("before", "after"):
        assert set(pref[when]) == {"preference_accuracy", "preference_margin", "preference_pairs"}
        assert pref[when]["preference_pairs"] == 16 and 0 <= pref[when]["preference_accuracy"] <= 1
    assert pref["after"]["preference_margin"] > pref["before"]["preference_margin"]
    with fed.state.session() as s:
        row = s.get(Checkpoint, rnd.published_sha256)
        assert json.loads(row.manifest_json)["preference"] == pref and row.heldout_loss is not None

    assert report["rewards"]["scoring_loss"].startswith("preference")
    scores = {s["contributor"]: s for s in report["rewards"]["scores"]}
    assert scores[helpful]["score"] > 0 and scores[harmful]["score"] == 0 and scores[noop]["score"] == 0
    paid = {c: balance_of(fed.state, c)["balance"] for c in (helpful, harmful, noop)}
    assert paid[helpful] > paid[harmful] and paid[helpful] > paid[noop]


def test_preference_gradient_predicts_the_loss_change(tmp_path):
    """First-order scoring's slope <g, delta> on the pairs' loss matches a finite difference; a file of pairs
    only measures its held-out loss on the chosen answers."""
    import torch

    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator
    from zoo_gym.gym_train.formats import load_validation

    pairs = [r for r in load_validation(_validation_file(tmp_path / "val.jsonl")) if "chosen" in r][:6]
    ev = ServerEvaluator(tiny_model_dir(), pairs)
    assert len(ev.loss_examples) == 6 and ev.heldout_loss() > 0
    g = ev.gradient()
    names = [k for k, t in g.grad.items() if t.dim() == 2 and "embed" not in k][:2]
    delta = {k: -g.grad[k] / g.grad[k].norm() for k in names}
    eps = 1e-3
    slope = sum(float((g.grad[k] * v).sum()) for k, v in delta.items())
    diff = (ev.scoring.loss(delta, scale=eps) - ev.scoring.loss(delta, scale=-eps)) / (2 * eps)
    assert slope < 0 and diff == pytest.approx(slope, rel=0.1)
    assert ev.scoring.loss(None) == pytest.approx(g.base_loss, rel=1e-4)
    assert torch.isfinite(torch.tensor(g.norm))


def test_with_pairs_the_genesis_loss_is_measured_once_and_the_log_names_what_was_prepared(
        federation_with, tmp_path, monkeypatch, caplog):
    """The held-out loss of a base is one pass over the records it runs on: with pairs, the genesis's was
    measured twice by its first publish (and claimed by the "prepared while open" line, which had skipped it).
    That line names only what it computed: round 2's base comes with its evaluator from round 1's publish."""
    import logging
    import threading
    import time

    from zoo_gym.evaluation import server_evaluator

    passes = []
    real = server_evaluator._loss_sum

    def counted(model, tokenizer, examples):
        if threading.current_thread().name == "round-manager":  # not `init`'s own measurement
            passes.append(len(examples))
        return real(model, tokenizer, examples)

    monkeypatch.setattr(server_evaluator, "_loss_sum", counted)
    caplog.set_level(logging.INFO, logger="zoo_gym.server")
    val = _validation_file(tmp_path / "val.jsonl")
    fed = federation_with(min_contributors=2, aggregator="mean", validation_data=str(val), validation_examples=24)

    def line(prefix: str) -> str:
        deadline = time.monotonic() + 120
        while True:
            found = [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no log line starting {prefix!r} within 120 s"
            time.sleep(0.1)

    first = line("round 1 base ")
    assert "prepared while open (evaluator, scoring gradient, held-out loss) in" in first
    assert fed.rounds.evaluators.for_base(fed.round().base_sha256).has_heldout  # measured while open, kept
    assert passes == [8]  # the 8 plain records
    for seed in range(2):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    fed.wait_published(1)
    assert passes == [8, 8]  # the genesis's once (while open), the published checkpoint's once
    second = line("round 2 base ")
    assert "prepared while open (scoring gradient) in" in second  # its evaluator and loss came with its publish
