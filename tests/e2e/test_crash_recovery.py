"""A server killed (SIGKILL) at any step of publishing a round publishes, after restart, exactly what an
uninterrupted run publishes: the same checkpoint sha256, one ledger entry per submission, a ledger that
verifies, no acknowledged submission lost and no orphaned blob or scratch directory.

Issue 12 item 3: settlement used to commit the new reputations on its own, so the redo weighted the merge
with reputations this same round had already moved (0.3384 / 0.3233 / 0.3384 instead of 1/3 each).
Real `gym-server serve` processes; `ZOO_GYM_FAULT_AT=<point>` makes the server kill itself at that point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors import safe_open
from sqlmodel import select

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.server.rounds.faults import FAULT_ENV, POINTS

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop(FAULT_ENV, None)
KEYS = [Ed25519PrivateKey.from_private_bytes(bytes([7 + i]) * 32) for i in range(3)]
SERVER_KEY = Ed25519PrivateKey.from_private_bytes(bytes([42]) * 32)


@pytest.fixture(scope="module")
def payloads() -> list[bytes]:
    """Three real LoRA deltas of different quality, so their scores and next reputations differ (with
    equal reputations after settlement, a redo that read them would still merge uniformly)."""
    from zoo_gym.gym_train.config import TrainConfig
    from zoo_gym.gym_train.tasks import builtin_examples
    from zoo_gym.gym_train.train import train

    out = []
    for i in range(3):
        result = train(tiny_model_dir(), builtin_examples(n=64, shard=i, n_shards=4),
                       TrainConfig(method="lora", max_steps=4 + 6 * i, batch_size=8, warmup_steps=0, seed=i),
                       base_sha256="0" * 64)
        out.append(codec.encode(result.delta, codec="bitdelta"))
    return out


def _wait(predicate, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _serve(state_dir: Path, log: Path, fault: str | None) -> tuple[subprocess.Popen, int]:
    port_file = state_dir.parent / "port"
    port_file.unlink(missing_ok=True)
    env = {**ENV, FAULT_ENV: fault} if fault else ENV
    proc = subprocess.Popen([sys.executable, "-m", "zoo_gym.server", "serve", "--insecure", "--state-dir",
                             str(state_dir),
                             "--port", "0", "--port-file", str(port_file), "--min-contributors", "3"],
                            stderr=open(log, "a"), env=env)

    def port():
        if proc.poll() is not None:
            raise AssertionError(f"gym-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        text = port_file.read_text().strip() if port_file.exists() else ""
        return int(text) if text else 0

    return proc, _wait(port, timeout=120, what="gym-server to listen")


def _round_id(port: int) -> int:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return gym_pb2_grpc.GymStub(ch).GetRound(gym_pb2.GetRoundRequest(), timeout=10).round_id


def _submit_all(port: int, payloads: list[bytes]) -> None:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = gym_pb2_grpc.GymStub(ch)
        for key, payload in zip(KEYS, payloads):  # one after the other: a fixed arrival order
            cid = stub.Register(register_request(key, "crash-test"), timeout=30).contributor_id
            info = stub.GetRound(gym_pb2.GetRoundRequest(), timeout=10)
            header = build_header(key=key, contributor_id=cid, round_id=info.round_id,
                                  base_sha256=info.base_sha256, payload=payload, metadata={})
            stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16), timeout=60)


def _run(root: Path, fault: str | None, payloads: list[bytes]) -> dict:
    """One federation: 3 submissions to round 1, killed at `fault` (if any), restarted, round 1 published."""
    from zoo_gym.server.store.models import Checkpoint, Round, Submission
    from zoo_gym.server.rounds.settlement import ledger_entries
    from zoo_gym.server.store.queries import verify_ledger
    from zoo_gym.server.store.state import open_state
    from zoo_gym.server.genesis import init_state

    state_dir, log = root / "state", root / "server.log"
    init_state(state_dir, base_model="tiny").engine.dispose()
    # The published lineage carries the server's signature, so "the same inputs" include the server's key
    # (Ed25519 signs deterministically): every run serves with the same one.
    (state_dir / "server_key.pem").write_bytes(SERVER_KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    proc, port = _serve(state_dir, log, fault)
    try:
        _submit_all(port, payloads)
        if fault:
            assert proc.wait(timeout=120) == -signal.SIGKILL, log.read_text()[-2000:]
            proc, port = _serve(state_dir, log, None)
        _wait(lambda: _round_id(port) == 2, timeout=120, what="round 1 to be published")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    state = open_state(state_dir)
    try:
        with state.session() as s:
            rnd = s.get(Round, 1)
            subs = list(s.exec(select(Submission)))
            referenced = {x.payload_sha256 for x in subs} | {c.sha256 for c in s.exec(select(Checkpoint))}
        stored = {p.name for p in (state.blobs.root / "sha256").rglob("*") if p.is_file()}
        entries = ledger_entries(state, contributor=None, since_seq=0, limit=None)
        return {"sha256": rnd.published_sha256, "submissions": len(subs), "orphans": stored - referenced,
                "scratch": [p.name for p in state.work_dir.iterdir() if p.name != "checkpoints"]
                + [p.name for p in state.blobs.tmp_dir.iterdir()],
                "entries": sorted((e["round_id"], e["contributor_id"], e["amount"]) for e in entries),
                "verified": verify_ledger(state)["ok"]}
    finally:
        state.engine.dispose()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, payloads):
    return _run(tmp_path_factory.mktemp("uninterrupted"), None, payloads)


@pytest.mark.parametrize("trial", range(2))
@pytest.mark.parametrize("point", POINTS)
def test_kill_at_each_publish_step_publishes_the_same_checkpoint(uninterrupted, payloads, tmp_path, point, trial):
    assert uninterrupted["verified"] and len(uninterrupted["entries"]) == 3
    assert len({amount for _, _, amount in uninterrupted["entries"]}) > 1  # unequal pay: reputations move apart
    got = _run(tmp_path, point, payloads)
    assert got["sha256"] == uninterrupted["sha256"]
    assert got["submissions"] == 3  # no acknowledged submission lost
    assert got["entries"] == uninterrupted["entries"]  # one entry per submission, paid as in the clean run
    assert got["verified"]
    assert got["orphans"] == set() and got["scratch"] == []
