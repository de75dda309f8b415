"""Rewards scored on exact match (--scoring-metric exact-match): the 0-1 loss taken from one packed forward pass
is greedy decoding's, answer for answer, with and without a delta; a real server round pays the deltas that
taught the validation answers and nothing to a random delta of their size, with subsets formed by the report's
weighted mean or by the round's own rule (--scoring-subsets rule: the marginals add up to what the published
release gained); the settings refuse what cannot work."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zoo_gym import codec
from zoo_gym.evaluation.evaluate import collate, tokenize_examples
from zoo_gym.evaluation.packing import PackedScoringSet
from zoo_gym.evaluation.server_evaluator import ServerEvaluator
from zoo_gym.gym_train import default_validation_examples, tiny_model_dir
from zoo_gym.gym_train.exact_match import generation_prompt_ids, load_for_eval
from zoo_gym.server.config import ConfigError, build_config


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding's tokens after `prompt` (at most `n`, through the end-of-turn token if it comes) and the
    smallest top-1 minus top-2 logit margin among them."""
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return out.sequences[0, len(prompt):].tolist(), margin


def _plus(model, delta):
    """A copy of `model` with `delta` added to its weights."""
    import copy

    other = copy.deepcopy(model)
    params = dict(other.named_parameters())
    with torch.no_grad():
        for k, v in delta.items():
            params[k].add_(v)
    return other


def test_zero_one_loss_is_greedy_decodings_answer_for_answer_with_and_without_a_delta():
    model, tok = load_for_eval(tiny_model_dir())
    prompts = [generation_prompt_ids(tok, ex) for ex in default_validation_examples(n=24)]
    g = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.named_parameters()
             if k.endswith("mlp.down_proj.weight")}
    moved = _plus(model, delta)
    pairs, expect_base, expect_moved = [], [], []
    for i, p in enumerate(prompts):
        base, m0 = _greedy(model, p, 3)
        other, m1 = _greedy(moved, p, 3)
        if min(m0, m1) < 1e-3:  # a near tie: float summation order (packed or not, this CPU) may break it
            continue
        answer = base if i % 3 else base[:-1] + [(base[-1] + 1) % len(tok)]  # every third: a wrong last token
        pairs.append((p, answer))
        expect_base.append(answer != base)
        expect_moved.append(answer != other)
    assert len(pairs) >= 16 and any(expect_base) and not all(expect_base)
    assert expect_moved != expect_base  # the delta changes some greedy answers: the check can tell
    scoring = PackedScoringSet(model, pairs, pad_id=tok.pad_token_id or 0, row_tokens=96)
    assert scoring.batch.input_ids.shape[0] > 1 and scoring.batch.prefix > 0  # several rows, a shared prefix
    assert scoring.zero_one_loss() == pytest.approx(sum(expect_base) / len(pairs))
    assert scoring.zero_one_loss(delta) == pytest.approx(sum(expect_moved) / len(pairs))
    assert scoring.zero_one_loss() == pytest.approx(sum(expect_base) / len(pairs))  # weights restored


def _teach(model_dir, examples: list[dict], steps: int = 80) -> dict[str, torch.Tensor]:
    """A delta that teaches `model_dir` the examples' answers (Adam on their completion loss, bounded)."""
    from zoo_gym.gym_train.exact_match import exact_match

    model, tok = load_for_eval(model_dir)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    batch = collate(tokenize_examples(tok, examples), pad_id=tok.pad_token_id or 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        model.train()
        loss = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            model.eval()
            if exact_match(model, tok, examples, max_new_tokens=4).accuracy == 1.0:
                break
    model.eval()
    assert exact_match(model, tok, examples, max_new_tokens=4).accuracy == 1.0, "the teacher did not learn"
    return {k: (v.detach() - start[k]).float() for k, v in model.named_parameters()}


def _like(delta: dict[str, torch.Tensor], seed: int, share: float) -> dict[str, torch.Tensor]:
    """Gaussian noise whose norm is `share` of `delta`'s, in its shapes."""
    g = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(v.shape, generator=g) for k, v in delta.items()}
    norm = lambda d: float(torch.cat([v.reshape(-1) for v in d.values()]).norm())  # noqa: E731
    return {k: v * (share * norm(delta) / norm(noise)) for k, v in noise.items()}


@pytest.mark.slow
@pytest.mark.parametrize("subsets, aggregator, release_gain", [("mean", "mean", None), ("rule", "median", 1.0)])
def test_a_round_scored_on_exact_match_pays_the_deltas_that_taught_the_answers(federation_with, tmp_path, subsets,
                                                                               aggregator, release_gain):
    """With rule subsets a fourth identity sends the second teacher's bytes: a copy, which must neither be paid
    nor take its author's leave-one-out value (the median groups copies, so leaving out the author alone would
    change nothing)."""
    examples = [{"instruction": f"Name the colour of item {i}.", "input": "", "output": "red"} for i in range(16)]
    vfile = tmp_path / "validation.jsonl"
    vfile.write_text("".join(json.dumps(ex) + "\n" for ex in examples))
    copy = subsets == "rule"
    fed = federation_with(validation_file=vfile, min_contributors=3 + copy, aggregator=aggregator,
                          scoring_method="exact",
                          scoring_metric="exact-match", scoring_examples=16, scoring_subsets=subsets,
                          scoring_marginal="leave_one_out" if subsets == "rule" else "gtg_shapley")
    info = fed.round()
    shapes = fed.base_shapes()
    taught = {k: v for k, v in _teach(fed.state.checkpoint_dir(info.base_sha256), examples).items()
              if k in shapes and v.any()}
    also = {k: v + d for (k, v), d in zip(taught.items(), _like(taught, 2, 0.01).values())}  # a second teacher
    ids = []
    payloads = [codec.encode(d, codec="fp16") for d in (taught, also, _like(taught, 1, 1.0))]  # 3rd: random
    for payload in payloads + payloads[1:2] * copy:
        key, cid = fed.register()
        fed.submit(key, cid, payload)
        ids.append(cid)
    report = json.loads(fed.wait_published(1).report_json)
    rewards = report["rewards"]
    assert rewards["method"].startswith("exact") and rewards["scoring_loss"].startswith("0-1")
    assert ("round's rule" in rewards["method"]) == (subsets == "rule")
    assert rewards["scoring_base_loss"] == 1.0  # the base answers none of the 16 questions
    paid = {p["contributor"]: p["amount"] for p in rewards["payouts"]}
    scores = {s["contributor"]: s for s in rewards["scores"]}
    assert paid[ids[0]] > 0 and paid[ids[1]] > 0 and paid.get(ids[2], 0) == 0, scores
    assert scores[ids[0]]["solo_gain"] == pytest.approx(1.0)  # alone, a teacher's delta answers all 16
    # each marginal comes with its standard error over the 16 questions (per-question 0-1 losses were scored)
    assert all(math.isfinite(scores[c]["marginal_error"]) for c in ids[:3]), scores
    assert scores[ids[2]]["solo_gain"] <= 0.0 and "did not improve" in scores[ids[2]]["reason"]
    if release_gain is not None:  # the median of the three is between the teachers: it answers all 16 ...
        # ... so leaving out the random delta changes nothing, and leaving out a teacher leaves a mean of a
        # teacher and noise that answers none: each teacher's marginal is the release's whole gain
        assert [scores[c]["marginal"] for c in ids] == pytest.approx([release_gain, release_gain, 0.0, 0.0])
        assert paid.get(ids[3], 0) == 0 and "byte-identical copy" in scores[ids[3]]["reason"]


def test_exact_match_scoring_needs_exact_scoring_and_answers_not_pairs(tmp_path):
    with pytest.raises(ConfigError, match="--scoring-method exact"):
        build_config({}, scoring_metric="exact-match")
    with pytest.raises(ConfigError, match="scoring_metric"):
        build_config({}, scoring_metric="accuracy", scoring_method="exact")
    pairs = [{"instruction": f"q{i}", "input": "", "chosen": "yes", "rejected": "no"} for i in range(4)]
    with pytest.raises(ValueError, match="preference pairs: use --scoring-metric loss"):
        ServerEvaluator(tiny_model_dir(), pairs, scoring_examples=4, metric="exact-match")


def test_rule_subsets_clip_each_delta_where_the_release_did(tmp_path):
    """With adaptive DP clipping the release clips at the round's adapted norm, not at --dp-clip: the scoring
    subsets must too, or a leave-one-out value measures a release that never was."""
    from zoo_gym.server.rounds.settlement import RuleSubsets
    from zoo_gym.server.rounds.stored_deltas import StoredDeltas

    deltas = [{"w": torch.full((64,), 1.0 + i)} for i in range(3)]
    paths = []
    for i, d in enumerate(deltas):
        paths.append(tmp_path / f"{i}.delta")
        paths[-1].write_bytes(codec.encode(d))
    source = StoredDeltas(paths, ["a", "b", "c"], {"w": (64,)})
    config = build_config({}, port=0, aggregator="mean", dp_noise_multiplier=1.0, dp_clip=100.0,
                          dp_adaptive_clip=True, dp_expected_contributors=3, scoring_method="exact",
                          scoring_subsets="rule")
    adapted = RuleSubsets(config, source, None, None, None, dp_clip=0.5).aggregate([0, 1, 2])
    configured = RuleSubsets(config, source, None, None, None).aggregate([0, 1, 2])
    assert float(adapted["w"].norm()) <= 0.5 + 1e-5  # each delta clipped to 0.5: their mean too
    assert float(configured["w"].norm()) > 10.0  # at --dp-clip 100 nothing is clipped: another release
