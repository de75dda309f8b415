"""Asynchronous buffered rounds (`--mode async`) in process: a real server, signed submissions over gRPC.

A delta may name any of the last max_staleness bases; older is FAILED_PRECONDITION naming the current
version and stores nothing. Every buffer_size deltas publish a version equal to base + server_lr x the
aggregate, by default (exact, with the plain mean) the deltas' staleness-weighted average (FedBuff's sum / K
without the normalisation and under DP); Multi-Krum selects on the weighted rows it averages, so fresh
colluding attackers hiding among the deltas as submitted do not outweigh the stale honest ones; a stale
delta is paid less than the same delta fresh, never refused; a flush interrupted after its blob is written
is redone with the same checkpoint and the same ledger.
"""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from safetensors.torch import load_file
from sqlmodel import select

from zoo_gym import codec
from zoo_gym.proto import gym_pb2
from zoo_gym.server.rounds.async_rounds import staleness_weight
from zoo_gym.server.store.models import Round, RoundInputs, RoundState, Submission
from zoo_gym.server.rounds.manager import RoundManager
from zoo_gym.server.rounds.settlement import ledger_entries
from zoo_gym.server.store.queries import verify_ledger
from zoo_gym.server.store.state import open_state

ASYNC = dict(mode="async", buffer_size=2, max_staleness=1, aggregator="mean")


def _weights(fed, sha: str) -> dict[str, torch.Tensor]:
    return load_file(str(fed.state.checkpoint_dir(sha) / "model.safetensors"))


def test_staleness_weight_is_polynomial():
    assert staleness_weight(0, exponent=0.5) == 1.0
    assert staleness_weight(3, exponent=0.5) == pytest.approx(0.5)  # (1 + 3) ** -0.5
    assert staleness_weight(1, exponent=1.0) == pytest.approx(0.5)
    assert staleness_weight(7, exponent=0.0) == 1.0  # exponent 0: no discount
    assert [staleness_weight(s, exponent=2.0) for s in range(4)] == pytest.approx([1, 1 / 4, 1 / 9, 1 / 16])


def test_staleness_is_an_aggregation_weight_only_for_the_mean():
    from zoo_gym.aggregation import SoupConfig
    from zoo_gym.aggregation.config import AGGREGATORS
    from zoo_gym.server.rounds.async_rounds import staleness_applied, step_scale

    applied = {rule: staleness_applied(SoupConfig(aggregator=rule, dp_clip=1.0)) for rule in AGGREGATORS}
    # robust rules select and trim on the weighted rows they average: no fresh row outweighs a stale one it hid among
    assert {rule for rule, how in applied.items() if how == "weights"} == {"mean"}
    assert staleness_applied(SoupConfig(aggregator="mean", dp_noise_multiplier=1.0, dp_clip=1.0,
                                        dp_expected_contributors=2)) == "rows"
    w = [1.0, 0.25, 0.25, 0.5]  # sum 2, K = 4
    assert step_scale(w, normalize=True, applied="rows") == 2.0  # K / sum w: the weighted rows' mean -> average
    assert step_scale(w, normalize=True, applied="weights") == 1.0  # the rule already averages with w
    assert step_scale(w, normalize=False, applied="rows") == 1.0  # FedBuff's sum / K of the weighted rows
    assert step_scale(w, normalize=False, applied="weights") == 0.5  # the same sum / K from the average
    with pytest.raises(ValueError, match="'rows' or 'weights'"):
        step_scale(w, normalize=True, applied="both")


def test_round_info_says_async_and_is_signed(federation_with, sign):
    fed = federation_with(**ASYNC, validation_examples=0, server_lr=0.5, staleness_exponent=1.0)
    info = fed.round()
    assert (info.mode, info.buffer_size, info.max_staleness, info.server_lr, info.staleness_exponent) == (
        "async", 2, 1, 0.5, 1.0)
    assert info.deadline_unix == 0  # a buffer flushes at buffer_size deltas, not at a deadline
    sign.verify(bytes(info.server_public_key), bytes(info.signature), sign.round_info_bytes(info))
    forged = gym_pb2.RoundInfo()
    forged.CopyFrom(info)
    forged.max_staleness = 9  # a man in the middle widening the window: the signature no longer verifies
    with pytest.raises(sign.SignatureError):
        sign.verify(bytes(info.server_public_key), bytes(forged.signature), sign.round_info_bytes(forged))


@pytest.mark.parametrize("normalize", [True, False])
def test_flush_is_server_lr_times_mean_of_staleness_weighted_deltas(federation_with, normalize):
    lr, a = 0.5, 1.0
    fed = federation_with(**ASYNC, validation_examples=0, server_lr=lr, staleness_exponent=a,
                          reputation_weighting=False, staleness_normalize=normalize)
    (ka, ca), (kb, cb), (kc, cc), (kd, cd) = (fed.register() for _ in range(4))
    d = {name: fed.small_delta(seed=seed, scale=1e-2) for name, seed in zip(("A", "B", "C", "A2", "D"), range(5))}
    base0 = fed.round().base_sha256
    fed.submit(ka, ca, codec.encode(d["A"], codec="fp32"), round_id=1)
    fed.submit(kb, cb, codec.encode(d["B"], codec="fp32"), round_id=1)
    v1 = fed.wait_published(1).published_sha256
    # C trained on version 0 (round 1's base): one version old, accepted into round 2's buffer
    resp = fed.submit(kc, cc, codec.encode(d["C"], codec="fp32"), round_id=1, base_sha256=base0)
    assert resp.round_id == 2
    fed.submit(ka, ca, codec.encode(d["A2"], codec="fp32"), round_id=2)
    v2 = fed.wait_published(2).published_sha256

    w1, w2 = _weights(fed, v1), _weights(fed, v2)
    w = staleness_weight(1, exponent=a)
    assert w == 0.5
    # normalised: the staleness-weighted average (w dC + dA2) / (w + 1); FedBuff's: the mean (w dC + dA2) / 2
    scale = 2 / (w + 1) if normalize else 1.0
    other = 1.0 if normalize else 2 / (w + 1)
    changed = 0
    for name, t in d["C"].items():
        expected = w1[name] + lr * scale * (w * t + d["A2"][name]) / 2
        assert torch.allclose(w2[name], expected, atol=1e-6), name
        assert not torch.allclose(w2[name], w1[name] + lr * (t + d["A2"][name]) / 2, atol=1e-6)  # w matters
        assert not torch.allclose(w2[name], w1[name] + lr * other * (w * t + d["A2"][name]) / 2, atol=1e-6)
        changed += 1
    assert changed
    with fed.state.session() as s:
        recorded = json.loads(s.get(RoundInputs, 2).staleness_json)
        first = json.loads(s.get(RoundInputs, 1).staleness_json)
    assert recorded["contributors"][cc] == {"base_round": 1, "staleness": 1, "weight": 0.5}
    assert recorded["contributors"][ca]["staleness"] == 0 and recorded["server_lr"] == lr
    # the mean weights what it keeps: w(s) is an aggregation weight, so the normalised step needs no scale
    assert recorded["staleness_applied"] == "weights"
    assert (recorded["staleness_normalize"], recorded["step_scale"]) == (
        normalize, 1.0 if normalize else pytest.approx((w + 1) / 2))
    assert first["step_scale"] == 1.0  # two fresh deltas: their weights average 1 already

    # D's delta against version 0 is now two versions old, past max_staleness = 1: refused, nothing stored
    stored, blobs = fed.stored_submissions(), fed.blob_count()
    with pytest.raises(grpc.RpcError) as refused:
        fed.submit(kd, cd, codec.encode(d["D"], codec="fp32"), round_id=1, base_sha256=base0)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "2 versions old" in refused.value.details() and "current version is 2" in refused.value.details()
    # a base that is not the named round's: refused too
    with pytest.raises(grpc.RpcError) as wrong:
        fed.submit(kd, cd, codec.encode(d["D"], codec="fp32"), round_id=2, base_sha256=base0)
    assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "round 2 trained on" in wrong.value.details()
    assert (fed.stored_submissions(), fed.blob_count()) == (stored, blobs)


def test_multi_krum_selects_on_the_weighted_rows_it_averages_so_fresh_colluders_are_not_outweighing(federation_with):
    # Prepare: K = 7, f = 2 (7 = 2f + 3), a = 2. Version 1 from 7 fresh deltas; then the buffer of version 2 holds
    # 5 honest deltas trained on version 0 (staleness 1, weight 1/4) and 2 colluding attackers who claim the newest
    # base (weight 1) and send mean - std of the honest deltas (ALIE): inside their spread as submitted, so a
    # Multi-Krum selecting on the deltas as submitted chose both and gave them 2 / (2 + 3/4) of the step.
    fed = federation_with(mode="async", buffer_size=7, max_staleness=1, aggregator="multi-krum", byzantine_f=2,
                          multi_krum_m=5, staleness_exponent=2.0, validation_examples=0, reputation_weighting=False)
    honest, attackers = [fed.register() for _ in range(5)], [fed.register() for _ in range(2)]
    mu = fed.small_delta(seed=100, scale=1e-2)
    deltas = [{k: m + fed.small_delta(seed=i, scale=3e-3)[k] for k, m in mu.items()} for i in range(5)]
    stacked = {k: torch.stack([d[k] for d in deltas]) for k in mu}  # (5, ...) per tensor
    alie = {k: x.mean(0) - x.std(0, unbiased=False) for k, x in stacked.items()}
    base0 = fed.round().base_sha256
    for key, cid in honest + attackers:
        fed.submit(key, cid, codec.encode(mu, codec="fp32"), round_id=1)
    v1 = fed.wait_published(1).published_sha256
    for (key, cid), d in zip(honest, deltas):
        fed.submit(key, cid, codec.encode(d, codec="fp32"), round_id=1, base_sha256=base0)  # one version stale
    for key, cid in attackers:
        fed.submit(key, cid, codec.encode(alie, codec="fp32"), round_id=2)  # fresh: weight 1
    v2 = fed.wait_published(2).published_sha256

    # Assert: Multi-Krum's m = n - f = 5 are the honest rows w x delta, averaged, x K / sum w over the buffer
    w = 0.25
    w1, w2 = _weights(fed, v1), _weights(fed, v2)
    for k in mu:
        honest_mean = stacked[k].mean(0)
        assert not torch.allclose(alie[k], honest_mean, atol=1e-4)  # the attackers' delta is observable
        assert torch.allclose(w2[k], w1[k] + 7 / (5 * w + 2) * w * honest_mean, atol=1e-6), k
    with fed.state.session() as s:
        recorded = json.loads(s.get(RoundInputs, 2).staleness_json)
    assert recorded["staleness_applied"] == "rows" and recorded["step_scale"] == pytest.approx(7 / (5 * w + 2))
    assert {recorded["contributors"][cid]["weight"] for _, cid in honest} == {w}


def test_async_multi_krum_averages_half_the_buffer_by_default_so_attackers_past_f_are_not_forced_in(federation_with):
    # Prepare: K = 7, f = 2, no multi-krum-m. Four deltas agree closely; three (as many as attackers past f would
    # be) lie apart. A round's m = n - f = 5 must average at least one of the three; K // 2 = 3 need not.
    fed = federation_with(mode="async", buffer_size=7, max_staleness=1, aggregator="multi-krum", byzantine_f=2,
                          validation_examples=0, reputation_weighting=False)
    members = [fed.register() for _ in range(7)]
    mu = fed.small_delta(seed=200, scale=1e-2)
    close = [{k: m + fed.small_delta(seed=i, scale=1e-6)[k] for k, m in mu.items()} for i in range(4)]
    apart = [{k: m + fed.small_delta(seed=50 + i, scale=3e-3)[k] for k, m in mu.items()} for i in range(3)]
    base = _weights(fed, fed.round().base_sha256)
    # Execute
    for (key, cid), d in zip(members, close + apart):
        fed.submit(key, cid, codec.encode(d, codec="fp32"), round_id=1)
    v1 = _weights(fed, fed.wait_published(1).published_sha256)
    # Assert: the version moved by the close deltas' mean (none of the three apart), and the flush recorded m = 3
    for k in mu:
        assert torch.allclose(v1[k] - base[k], mu[k], atol=1e-4), k
    with fed.state.session() as s:
        assert json.loads(s.get(RoundInputs, 1).staleness_json)["multi_krum_m"] == 3


def _helpful_delta(fed, sha: str, names: int = 4) -> dict[str, torch.Tensor]:
    """Minus a small multiple of the held-out loss's gradient at `sha`: a delta the scoring pays for."""
    from zoo_gym.gym_train import default_validation_examples
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator

    grad = ServerEvaluator(fed.state.checkpoint_dir(sha), default_validation_examples(n=32)).gradient().grad
    chosen = [k for k, g in grad.items() if g.dim() == 2 and "embed" not in k][:names]
    return {k: -1e-2 * grad[k] / grad[k].norm() for k in chosen}


def test_stale_delta_is_paid_less_than_the_same_delta_fresh(federation_with):
    fed = federation_with(**{**ASYNC, "max_staleness": 2}, validation_examples=32, reward_pool=1000,
                          staleness_exponent=0.5)
    (ka, ca), (kb, cb), (kc, cc), (kd, cd) = (fed.register() for _ in range(4))
    base0 = fed.round().base_sha256
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=1), codec="fp32"), round_id=1)
    fed.submit(kb, cb, codec.encode(fed.small_delta(seed=2), codec="fp32"), round_id=1)
    v1 = fed.wait_published(1).published_sha256
    payload = codec.encode(_helpful_delta(fed, v1), codec="fp32")
    fed.submit(kc, cc, payload, round_id=1, base_sha256=base0)  # the same delta, trained one version ago
    fed.submit(kd, cd, payload, round_id=2)  # ... and on the current version
    fed.wait_published(2)
    entries = {e["contributor_id"]: e for e in ledger_entries(fed.state, contributor=None, since_seq=0, limit=None)
               if e["round_id"] == 2}
    stale, fresh = entries[cc], entries[cd]
    assert stale["kind"] == fresh["kind"] == "reward"  # slow is never refused
    assert 0 < stale["amount"] < fresh["amount"]
    assert stale["amount"] == int(fresh["amount"] * staleness_weight(1, exponent=0.5))  # floor(amount x w)
    assert stale["score"] == pytest.approx(fresh["score"] * staleness_weight(1, exponent=0.5))
    assert "staleness 1" in stale["reason"] and "flush of version 2" in stale["reason"]
    assert "staleness 0" in fresh["reason"]
    assert verify_ledger(fed.state)["ok"]


def test_flush_interrupted_after_its_blob_is_redone_identically(federation_with, monkeypatch):
    fed = federation_with(**ASYNC, validation_examples=16, reward_pool=1000)
    (ka, ca), (kb, cb), (kc, cc) = (fed.register() for _ in range(3))
    base0 = fed.round().base_sha256
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=1), codec="fp16"), round_id=1)
    fed.submit(kb, cb, codec.encode(fed.small_delta(seed=2), codec="fp16"), round_id=1)
    fed.wait_published(1)
    fed.rounds.stop()  # the flush below runs by hand, as a restarted server's manager would
    fed.submit(kc, cc, codec.encode(fed.small_delta(seed=3), codec="fp16"), round_id=1, base_sha256=base0)
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=4), codec="fp16"), round_id=2)

    class Crash(Exception):
        pass

    def crash_at(point: str) -> None:
        if point == "blob-written":
            raise Crash(point)

    import zoo_gym.server.rounds.publish as publish

    monkeypatch.setattr(publish, "crash_point", crash_at)
    blobs_before = set(p.name for p in (fed.state.blobs.root / "sha256").rglob("*") if p.is_file())
    with pytest.raises(Crash):
        RoundManager(fed.state, fed.config).step()
    written = set(p.name for p in (fed.state.blobs.root / "sha256").rglob("*") if p.is_file()) - blobs_before
    with fed.state.session() as s:
        assert s.get(Round, 2).state == RoundState.AGGREGATING and s.get(Round, 3) is None
        assert json.loads(s.get(RoundInputs, 2).staleness_json)["contributors"][cc]["staleness"] == 1
    assert not [e for e in ledger_entries(fed.state, contributor=None, since_seq=0, limit=None) if e["round_id"] == 2]
    monkeypatch.undo()

    reopened = open_state(fed.state.root)
    try:
        RoundManager(reopened, fed.config).step()  # the restart's redo from the recorded inputs
        with reopened.session() as s:
            r2 = s.get(Round, 2)
            assert r2.state == RoundState.PUBLISHED and s.get(Round, 3).state == RoundState.OPEN
            assert {sub.contributor_id for sub in s.exec(select(Submission).where(Submission.round_id == 2))} == {
                ca, cc}
        assert r2.published_sha256 in written  # the same checkpoint bytes as the interrupted run wrote
        entries = [e for e in ledger_entries(reopened, contributor=None, since_seq=0, limit=None)
                   if e["round_id"] == 2]
        assert sorted(e["contributor_id"] for e in entries) == sorted([ca, cc])
        assert "staleness 1" in next(e["reason"] for e in entries if e["contributor_id"] == cc)
        assert verify_ledger(reopened)["ok"]
    finally:
        reopened.engine.dispose()


def test_each_flush_is_one_dp_release_composed_by_the_accountant(federation_with):
    from zoo_gym.aggregation.privacy import epsilon as rdp_epsilon  # the reported figure (PRV, <= RDP)

    fed = federation_with(**{**ASYNC, "max_staleness": 2}, validation_examples=0, dp_noise_multiplier=1.0,
                          dp_clip=0.05, dp_expected_contributors=2)
    (ka, ca), (kb, cb), (kc, cc) = (fed.register() for _ in range(3))
    base0 = fed.round().base_sha256
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=1), codec="fp16"), round_id=1)
    fed.submit(kb, cb, codec.encode(fed.small_delta(seed=2), codec="fp16"), round_id=1)
    r1 = fed.wait_published(1)
    fed.submit(kc, cc, codec.encode(fed.small_delta(seed=3), codec="fp16"), round_id=1, base_sha256=base0)  # stale
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=4), codec="fp16"), round_id=2)
    r2 = fed.wait_published(2)
    delta = fed.round().dp_delta
    # participation public (the ledger): each flush charged replace-one, z / 2 at q = 1
    assert r1.dp_epsilon_total == pytest.approx(rdp_epsilon([(0.5, 1.0, 1)], delta=delta))
    assert r2.dp_epsilon_total == pytest.approx(rdp_epsilon([(0.5, 1.0, 2)], delta=delta))  # two flushes, two steps
    assert r2.dp_epsilon_round == pytest.approx(r1.dp_epsilon_round)
    with fed.state.session() as s:  # under DP the step is FedBuff's sum / K: the noise is calibrated for it
        recorded = json.loads(s.get(RoundInputs, 2).staleness_json)
    assert recorded["contributors"][cc]["weight"] < 1 and not recorded["staleness_normalize"]
    assert recorded["step_scale"] == 1.0 and recorded["staleness_applied"] == "rows"  # weighted before the clip
    assert fed.round().dp_epsilon_spent == pytest.approx(r2.dp_epsilon_total)


def test_serve_refuses_async_settings_that_cannot_work(tmp_path):
    from typer.testing import CliRunner

    from zoo_gym.server.cli import app
    from zoo_gym.server.config import ConfigError, build_config

    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path / "none"), "--insecure", "--mode", "async",
                                   "--buffer-size", "2", "--aggregator", "krum", "--byzantine-f", "1"])
    assert res.exit_code != 0 and "--buffer-size 2 is too few for --aggregator krum" in res.output
    assert len(res.output.strip().splitlines()) == 1
    for bad, named in (({"mode": "asynch"}, "`mode`"), ({"max_staleness": -1}, "`max_staleness`"),
                       ({"server_lr": 0.0}, "`server_lr`"), ({"buffer_size": 0}, "`buffer_size`"),
                       ({"staleness_exponent": -0.5}, "`staleness_exponent`")):
        with pytest.raises(ConfigError, match=named):
            build_config({}, **bad)
    assert build_config({"mode": "async", "buffer-size": 4, "max-staleness": 2}).buffer_size == 4  # file keys


def test_every_flush_holds_exactly_buffer_size_deltas_and_the_rest_wait(federation_with, caplog):
    # Prepare: K = 3; the round manager is stopped while 5 deltas arrive, as when deltas land between the
    # manager's count and its lock.
    import logging

    fed = federation_with(**{**ASYNC, "buffer_size": 3}, validation_examples=0)
    fed.rounds.stop()
    senders = [fed.register() for _ in range(6)]
    for i, (key, cid) in enumerate(senders[:5]):
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=i), codec="fp16"), round_id=1)
    manager = RoundManager(fed.state, fed.config)
    # Execute: one flush
    with caplog.at_level(logging.INFO, logger="zoo_gym.server"):
        manager.step()
    # Assert: version 1 from the first 3 deltas; the other 2 wait in the next buffer, and the log says 3
    with fed.state.session() as s:
        v1 = s.get(Round, 1)
        buffered = list(s.exec(select(Submission).where(Submission.round_id == 2)))
        first = json.loads(s.get(RoundInputs, 1).staleness_json)["contributors"]
    assert v1.state == RoundState.PUBLISHED
    assert sorted(first) == sorted(cid for _, cid in senders[:3])
    assert sorted(x.contributor_id for x in buffered) == sorted(cid for _, cid in senders[3:5])
    assert "round 1 closed with 3 submissions" in caplog.text
    assert "from 3 submissions" in caplog.text or "3 submissions" in caplog.text
    # the waiting deltas were trained on version 0: one version old in the second flush
    key, cid = senders[5]
    fed.submit(key, cid, codec.encode(fed.small_delta(seed=9), codec="fp16"), round_id=2)
    manager.step()
    with fed.state.session() as s:
        second = json.loads(s.get(RoundInputs, 2).staleness_json)["contributors"]
        assert s.get(Round, 2).state == RoundState.PUBLISHED
    assert len(second) == 3
    assert {second[c]["staleness"] for _, c in senders[3:5]} == {1} and second[cid]["staleness"] == 0


def test_a_delta_past_a_full_buffer_is_acknowledged_with_the_buffer_it_is_stored_under(federation_with):
    """The (K+1)-th delta of buffer r, taken before the manager closes r, waits in buffer r + 1: its
    SubmitResponse says r + 1 (the round it is stored under), so the client reports buffer and staleness truly."""
    from zoo_gym.client.contribute import SubmitResult
    from zoo_gym.client.join_async import Versions

    fed = federation_with(**ASYNC, validation_examples=0)  # K = 2, max staleness 1
    fed.rounds.stop()  # as when deltas land between the manager's count and its close
    senders = [fed.register() for _ in range(3)]
    acks = [fed.submit(key, cid, codec.encode(fed.small_delta(seed=i), codec="fp16"), round_id=1)
            for i, (key, cid) in enumerate(senders)]
    assert [(a.round_id, a.submissions) for a in acks] == [(1, 1), (1, 2), (2, 1)]
    with fed.state.session() as s:
        stored = {sub.id: sub.round_id for sub in s.exec(select(Submission))}
    assert [stored[a.submission_id] for a in acks] == [1, 1, 2]
    result = SubmitResult(trained_on=1, round_id=int(acks[2].round_id), contributor=senders[2][1], payload_bytes=1,
                          payload_sha256=acks[2].payload_sha256, submissions_in_round=acks[2].submissions,
                          metadata={}, codecs=["fp16"])
    said = []
    Versions(opts=None).submitted(type("C", (), {"say": said.append})(), result)
    assert result.staleness == 1 and "to round 2's buffer (trained on version 0, staleness 1)" in said[0]
    RoundManager(fed.state, fed.config).step()  # the flush of buffer 1 holds the first two; nothing moves
    with fed.state.session() as s:
        assert s.get(Round, 1).state == RoundState.PUBLISHED
        assert s.get(Submission, acks[2].submission_id).round_id == 2
        assert sorted(json.loads(s.get(RoundInputs, 1).staleness_json)["contributors"]) == sorted(
            cid for _, cid in senders[:2])


def test_the_rule_says_how_it_sizes_itself_per_buffer():
    # issue 49: async_rounds asks the rule (Rule.per_buffer) instead of comparing its name to "multi-krum"
    from zoo_gym.aggregation import SoupConfig
    from zoo_gym.aggregation.config import AGGREGATORS
    from zoo_gym.server.rounds.async_rounds import buffer_multi_krum_m

    sized = {rule: buffer_multi_krum_m(SoupConfig(aggregator=rule), 9) for rule in AGGREGATORS}
    assert sized == {rule: 4 if rule == "multi-krum" else None for rule in AGGREGATORS}  # K // 2
    assert buffer_multi_krum_m(SoupConfig(aggregator="multi-krum", multi_krum_m=3), 9) == 3
    assert buffer_multi_krum_m(SoupConfig(aggregator="multi-krum"), 1) == 1
