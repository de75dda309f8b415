"""The default configuration survives one huge delta (issue 12 item 5), end to end through gRPC.

Three contributors under the defaults (no aggregator flag: trimmed-mean, max_norm_ratio 10): two
honest LoRA deltas trained on the tiny model and one with every weight of the trained delta's
tensors changed by 1e30 (finite). The huge one is refused by the norm bound, the published
checkpoint is as good as an honest-only round's (mean of the two), and both honest contributors
are paid. It used to be averaged in (held-out loss ln(vocab)) and the honest ones got refusals.
"""

from __future__ import annotations

import contextlib
import io
import time

import grpc
import pytest
import torch

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.server.config import build_config
from zoo_gym.server.store.models import Checkpoint, Round, RoundState
from zoo_gym.server.transport.servicer import build_server
from zoo_gym.server.rounds.settlement import ledger_entries
from zoo_gym.server.genesis import init_state


@pytest.fixture(scope="module")
def deltas() -> list[dict[str, torch.Tensor]]:
    """Two honest merged-LoRA deltas (disjoint shards of the built-in task) and the huge one."""
    from zoo_gym.gym_train import TrainConfig, builtin_examples, tiny_model_dir, train

    honest = []
    for shard in range(2):
        examples = builtin_examples("default", shard=shard, n_shards=2, n=128, seed=0)
        config = TrainConfig(method="lora", max_steps=16, batch_size=8, learning_rate=1e-2,
                             warmup_steps=2, merged_delta=True, seed=shard)
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its log dicts
            result = train(tiny_model_dir(), examples, config, base_sha256="0" * 64, eval_examples=[])
        honest.append({k: v.float().contiguous() for k, v in result.delta.items()})
    huge = {k: v + 1e30 for k, v in honest[0].items()}  # every weight changed by 1e30
    assert all(bool(torch.isfinite(v).all()) for v in huge.values())
    return [*honest, huge]


@contextlib.contextmanager
def _federation(tmp_path, **flags):
    state = init_state(tmp_path / "state", base_model="tiny")
    config = build_config({}, port=0, insecure=True, round_timeout=600, validation_examples=64,
                          max_payload_bytes=64 << 20, max_chunk_bytes=1 << 20, **flags)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield state, gym_pb2_grpc.GymStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        rounds.stop()
        state.engine.dispose()


def _submit(stub, delta: dict[str, torch.Tensor]) -> str:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    cid = stub.Register(register_request(key, "test")).contributor_id
    info = stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=cid))
    payload = codec.encode(delta, codec="fp32")  # 1e30 is finite in float32
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id,
                          base_sha256=info.base_sha256, payload=payload, metadata={"test": True})
    stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    return cid


def _published(state, timeout: float = 300.0) -> tuple[float, float]:
    """(held-out loss of round 1's base, of its published checkpoint)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with state.session() as s:
            r = s.get(Round, 1)
            if r.state == RoundState.PUBLISHED:
                base, out = s.get(Checkpoint, r.base_sha256), s.get(Checkpoint, r.published_sha256)
                return base.heldout_loss, out.heldout_loss
        time.sleep(0.2)
    raise AssertionError(f"round 1 was not published within {timeout} s (state {r.state})")


def test_one_huge_delta_is_refused_and_the_honest_round_publishes_and_pays(deltas, tmp_path):
    with _federation(tmp_path / "honest", min_contributors=2, aggregator="mean") as (state, stub):
        honest_ids = [_submit(stub, d) for d in deltas[:2]]
        base_loss, honest_loss = _published(state)
        honest_entries = ledger_entries(state, contributor=None, since_seq=0, limit=None)
    assert honest_loss < 0.5 * base_loss  # the honest deltas really improve the model
    honest_pay = {e["contributor_id"]: e["amount"] for e in honest_entries}

    with _federation(tmp_path / "default", min_contributors=3) as (state, stub):  # no aggregator
        ids = [_submit(stub, d) for d in deltas]
        _, loss = _published(state)
        entries = ledger_entries(state, contributor=None, since_seq=0, limit=None)
    assert abs(loss - honest_loss) <= 0.05 * honest_loss
    by = {e["contributor_id"]: e for e in entries}
    assert by[ids[2]]["kind"] == "refusal" and by[ids[2]]["amount"] == 0
    assert "max_norm_ratio" in by[ids[2]]["reason"] and "median delta norm" in by[ids[2]]["reason"]
    for cid, alone in zip(ids[:2], honest_ids):
        assert by[cid]["kind"] == "reward" and by[cid]["amount"] > 0, [by[c]["reason"] for c in ids]
        assert by[cid]["amount"] == honest_pay[alone]  # as if the huge delta had not been sent


def _report(state) -> dict:
    import json

    with state.session() as s:
        return json.loads(s.get(Round, 1).report_json)


def test_a_byte_copy_of_a_delta_is_paid_nothing_and_its_author_is_paid(deltas, tmp_path):
    with _federation(tmp_path / "copy", min_contributors=3, aggregator="mean") as (state, stub):
        author, other, copier = (_submit(stub, d) for d in (deltas[0], deltas[1], deltas[0]))
        _published(state)
        entries = ledger_entries(state, contributor=None, since_seq=0, limit=None)
    by = {e["contributor_id"]: e for e in entries}
    assert by[author]["amount"] > 0 and by[other]["amount"] > 0, [e["reason"] for e in entries]
    assert by[copier]["amount"] == 0
    assert f"byte-identical copy of an earlier submission of this round (by {author})" in by[copier]["reason"]


def test_first_order_gains_past_the_linear_regime_are_scored_exactly(deltas, tmp_path):
    """16 LoRA steps at lr 1e-2 halve the tiny model's held-out loss: the first-order gains pass 1 (a predicted
    loss below 0) and would all be capped alike; the round is then scored with exact held-out losses."""
    with _federation(tmp_path / "regime", min_contributors=2, aggregator="mean") as (state, stub):
        for d in deltas[:2]:
            _submit(stub, d)
        _published(state)
        rewards = _report(state)["rewards"]
    assert rewards["method"].startswith("exact (first order outside its linear regime: 2 of 2 first-order gains"), (
        rewards["method"])
    gains = [s["solo_gain"] for s in rewards["scores"]]
    assert all(0 < g < 1 for g in gains) and gains[0] != gains[1], gains  # exact gains, not the cap
