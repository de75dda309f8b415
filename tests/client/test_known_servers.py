"""Pinning the server per address, like ssh's known_hosts, and a ledger that cannot hide entries (issue 14 item 3).

Real in-process servers on 127.0.0.1; `gym-client` through Typer's CliRunner. An impostor is a second real
server started on the same address with a copy of the first one's key (a stolen key, or an old backup
put back) and its own ledger.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlmodel import Session, func, select
from typer.testing import CliRunner

from zoo_gym.client.cli import app
from zoo_gym.client.known_servers import UntrustedServer
from zoo_gym.client.server_signatures import verify_ledger_head, verify_round_info
from zoo_gym.proto import gym_pb2, gym_pb2_grpc, signing
from zoo_gym.rewards import Ledger, NewEntry
from zoo_gym.server.config import build_config
from zoo_gym.server.store.models import Submission
from zoo_gym.server.transport.servicer import build_server
from zoo_gym.server.store.state import open_state
from zoo_gym.server.genesis import init_state


class Running:
    def __init__(self, state_dir: Path, *, port: int = 0, key_from: Path | None = None) -> None:
        if not (state_dir / "state.json").exists():
            init_state(state_dir, base_model="tiny").engine.dispose()
            if key_from is not None:  # the impostor: same server key, its own (empty) ledger
                shutil.copyfile(key_from, state_dir / "server_key.pem")
        self.state = open_state(state_dir)
        config = build_config({}, port=port, insecure=True, min_contributors=2, aggregator="mean",
                              round_timeout=600, max_payload_bytes=4 << 20, max_chunk_bytes=1 << 20)
        self.server, self.port, self.rounds = build_server(self.state, config)
        self.server.start()
        self.rounds.start()
        self.address = f"127.0.0.1:{self.port}"

    def ledger(self) -> Ledger:
        return Ledger(lambda: Session(self.state.engine, expire_on_commit=False), self.state.key)

    def pay(self, contributor: str, n: int, amount: int = 10) -> None:
        self.ledger().append([NewEntry(round_id=1, contributor=contributor, kind="reward", amount=amount,
                                       score=0.5, reputation_after=0.5, reason=f"test {i}") for i in range(n)])

    def submissions(self) -> int:
        with self.state.session() as s:
            return int(s.exec(select(func.count()).select_from(Submission)).one())

    def stop(self) -> None:
        self.server.stop(grace=None).wait()
        self.rounds.stop()
        self.state.engine.dispose()


@pytest.fixture
def servers():
    started: list[Running] = []

    def start(state_dir: Path, **kw) -> Running:
        started.append(Running(state_dir, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _key(path: Path) -> str:
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return signing.contributor_id(signing.public_bytes(key))


def _rewards(address: str, key: Path, *extra: str):
    return CliRunner().invoke(app, ["rewards", "--server", address, "--insecure", "--key", str(key), "--verify",
                                    *extra])


def _join(address: str, key: Path, workdir: Path):
    return CliRunner().invoke(app, ["join", "--server", address, "--insecure", "--rounds", "1", "--max-steps", "8",
                                    "--threads", "1", "--workdir", str(workdir), "--key", str(key), "--no-wait",
                                    "--quiet"])


def test_one_contributor_key_joins_two_federations(servers, tmp_path):
    a, b = servers(tmp_path / "a"), servers(tmp_path / "b")
    key = tmp_path / "me" / "key.pem"
    for fed in (a, b):
        res = _join(fed.address, key, tmp_path / "work")
        assert res.exit_code == 0, res.output
        assert f"trusting the server at {fed.address} on first use" in res.output
        assert fed.submissions() == 1
    lines = [ln.split() for ln in (tmp_path / "me" / "known_servers").read_text().splitlines()
             if not ln.startswith("#")]
    assert lines == [[a.address, a.state.public_key.hex()], [b.address, b.state.public_key.hex()]]


def test_first_verify_says_it_trusts_on_first_use_and_pins_0600(servers, tmp_path):
    fed = servers(tmp_path / "a")
    key = tmp_path / "key.pem"
    _key(key)
    first = _rewards(fed.address, key, "--json")
    assert first.exit_code == 0, first.output
    known = tmp_path / "known_servers"
    assert f"trusting the server at {fed.address} on first use" in first.stderr and str(known) in first.stderr
    doc = json.loads(first.stdout)
    assert doc["verification"]["ok"] and doc["verification"]["trust_on_first_use"]
    assert os.stat(known).st_mode & 0o777 == 0o600
    again = _rewards(fed.address, key, "--json")
    assert again.exit_code == 0 and "first use" not in again.stderr
    assert not json.loads(again.stdout)["verification"]["trust_on_first_use"]


def test_a_swapped_server_key_for_a_pinned_address_is_refused(servers, tmp_path):
    genuine = servers(tmp_path / "genuine")
    key = tmp_path / "key.pem"
    _key(key)
    assert _rewards(genuine.address, key).exit_code == 0
    port = genuine.port
    genuine.stop()
    other = servers(tmp_path / "other", port=port)  # same address, another key
    assert other.state.public_key != genuine.state.public_key
    for res in (_rewards(other.address, key), _join(other.address, key, tmp_path / "work")):
        assert res.exit_code == 1
        line = res.output.strip().splitlines()[-1]
        assert "not the key" in line and f"{tmp_path / 'known_servers'} line 2" in line
        assert "delete line 2" in line and "announced a new key" in line
    assert other.submissions() == 0


def test_signed_round_info_and_ledger_head_verify_and_edits_do_not(servers, tmp_path):
    fed = servers(tmp_path / "a")
    fed.pay("ab" * 16, 2)
    channel = grpc.insecure_channel(fed.address)
    stub = gym_pb2_grpc.GymStub(channel)
    info = stub.GetRound(gym_pb2.GetRoundRequest())
    head = stub.GetLedgerHead(gym_pb2.LedgerHeadRequest())
    channel.close()
    pub = fed.state.public_key
    verify_round_info(info, server_key=pub, address=fed.address)
    verify_ledger_head(head, server_key=pub, address=fed.address)
    assert head.entries == 2 and head.last_hash == fed.ledger().head()[1]
    asker = gym_pb2.RoundInfo()
    asker.CopyFrom(info)
    asker.you_submitted = not info.you_submitted  # per asker, so not signed: the rest still verifies
    verify_round_info(asker, server_key=pub, address=fed.address)
    for field, value in (("base_sha256", "e" * 64), ("deadline_unix", info.deadline_unix + 60), ("round_id", 9)):
        forged = gym_pb2.RoundInfo()
        forged.CopyFrom(info)
        setattr(forged, field, value)
        with pytest.raises(UntrustedServer, match="not signed by the server's pinned key"):
            verify_round_info(forged, server_key=pub, address=fed.address)
    shorter = gym_pb2.LedgerHead(entries=1, last_hash=head.last_hash, signed_at_unix=head.signed_at_unix,
                                 signature=head.signature)
    with pytest.raises(UntrustedServer, match="not signed"):
        verify_ledger_head(shorter, server_key=pub, address=fed.address)


def test_an_impostor_with_an_empty_ledger_is_flagged(servers, tmp_path):
    genuine = servers(tmp_path / "genuine")
    key = tmp_path / "key.pem"
    cid = _key(key)
    genuine.pay(cid, 3)
    first = _rewards(genuine.address, key, "--json")
    assert first.exit_code == 0 and json.loads(first.stdout)["verification"]["ok"], first.output
    port = genuine.port
    genuine.stop()
    impostor = servers(tmp_path / "impostor", port=port, key_from=tmp_path / "genuine" / "server_key.pem")
    assert impostor.state.public_key == genuine.state.public_key and impostor.ledger().head() is None
    res = _rewards(impostor.address, key, "--json")
    assert res.exit_code == 1
    v = json.loads(res.stdout)["verification"]
    assert v["ok"] is False and "fewer than the 3 this client verified before" in v["reason"]


def test_a_rewritten_chain_is_flagged(servers, tmp_path):
    fed = servers(tmp_path / "a")
    key = tmp_path / "key.pem"
    cid = _key(key)
    fed.pay(cid, 3)
    assert _rewards(fed.address, key).exit_code == 0
    with fed.state.engine.begin() as conn:  # the operator replaces the history, signing it again with its key
        conn.execute(text("DELETE FROM ledger_entry"))
    fed.pay(cid, 4, amount=1)
    res = _rewards(fed.address, key, "--json")
    assert res.exit_code == 1
    v = json.loads(res.stdout)["verification"]
    assert v["ok"] is False and v["first_bad_seq"] == 3 and "rewritten" in v["reason"]


def _publish_round(fed: Running) -> gym_pb2.RoundInfo:
    """Two real signed submissions; returns the RoundInfo of round 2 (its base is checkpoint 1)."""
    import time

    import torch
    from safetensors import safe_open

    from zoo_gym import codec
    from zoo_gym.client.upload import build_header, register_request, request_stream

    channel = grpc.insecure_channel(fed.address)
    stub = gym_pb2_grpc.GymStub(channel)
    info = stub.GetRound(gym_pb2.GetRoundRequest())
    with safe_open(str(fed.state.checkpoint_dir(info.base_sha256) / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = [k for k, s in shapes.items() if len(s) == 2][:2]
    for seed in range(2):
        key = Ed25519PrivateKey.generate()
        cid = stub.Register(register_request(key, "test")).contributor_id
        g = torch.Generator().manual_seed(seed)
        payload = codec.encode({k: torch.randn(shapes[k], generator=g) * 1e-3 for k in names}, codec="bitdelta")
        header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                              payload=payload, metadata={"test": True})
        stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = stub.GetRound(gym_pb2.GetRoundRequest())
        if now.round_id == 2:
            channel.close()
            return now
        time.sleep(0.2)
    channel.close()
    raise AssertionError("round 1 was not published within 180 s")


def test_published_lineage_is_signed_and_an_edited_one_is_refused(servers, tmp_path):
    from zoo_gym.client.download import DownloadError, fetch_checkpoint
    from zoo_gym.proto import archive

    fed = servers(tmp_path / "a")
    info = _publish_round(fed)
    pub = fed.state.public_key
    channel = grpc.insecure_channel(fed.address)
    stub = gym_pb2_grpc.GymStub(channel)
    verify_round_info(info, server_key=pub, address=fed.address)
    model_dir = fetch_checkpoint(stub, info.base_sha256, info.base_size, tmp_path / "work", progress=False,
                                 server_key=pub)
    lineage = json.loads((model_dir / archive.LINEAGE).read_text())
    assert lineage["round"] == 1 and len(lineage[signing.LINEAGE_SIGNATURE]) == 128
    other = signing.public_bytes(Ed25519PrivateKey.generate())
    with pytest.raises(DownloadError, match="not signed by the pinned server key"):
        fetch_checkpoint(stub, info.base_sha256, info.base_size, tmp_path / "work", progress=False, server_key=other)
    assert not model_dir.exists()  # discarded, not kept for training
    model_dir = fetch_checkpoint(stub, info.base_sha256, info.base_size, tmp_path / "work", progress=False,
                                 server_key=pub)
    (model_dir / archive.LINEAGE).write_text(json.dumps({**lineage, "aggregator": "krum"}))
    with pytest.raises(DownloadError, match="not signed by the pinned server key"):
        fetch_checkpoint(stub, info.base_sha256, info.base_size, tmp_path / "work", progress=False, server_key=pub)
    channel.close()


def test_an_old_per_key_pin_of_the_same_server_carries_over_quietly(tmp_path):
    from zoo_gym.client.known_servers import KnownServers

    server_key = signing.public_bytes(Ed25519PrivateKey.generate())
    legacy = tmp_path / "key.pem.server.pub"
    legacy.write_text(server_key.hex() + "\n")
    said: list[str] = []
    known = KnownServers(tmp_path / "known_servers")
    assert known.trust("gym.example.org:50051", server_key, say=said.append, legacy=legacy) == server_key
    assert len(said) == 1 and "carried over" in said[0] and "first use" not in said[0]
    other = signing.public_bytes(Ed25519PrivateKey.generate())  # the old file knew one server: another is TOFU
    known.trust("other.example.org:50051", other, say=said.append, legacy=legacy)
    assert "first use" in said[-1] and known.get("other.example.org:50051").line == 3
