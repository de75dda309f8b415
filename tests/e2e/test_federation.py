"""The federation end to end with real processes: one `gym-server`, four `gym-client join` processes.

Scenario (one server, min 3 contributors per round):
  round 1: clients A, B, C          -> checkpoint 1, better than genesis on held-out loss
  round 2: clients A, B and D, a client that joined after round 1 was published -> checkpoint 2, better again
Everything runs over TLS with a private CA (zoo_gym.proto.tls). Then, against the same running server: a
plaintext client is refused at once, a stale-base submission is refused with FAILED_PRECONDITION and
not stored; an interrupted download resumes from its offset; the ledger verifies, and a contributor's
balance from the RPC equals the sum of its signed entries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from e2e_processes import ENV, client, open_round, status as _status, wait_for as _wait
from e2e_processes import server_cmd as _server
from zoo_gym import codec
from zoo_gym.client.download import fetch_checkpoint
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import archive, gym_pb2, gym_pb2_grpc
from zoo_gym.proto.tls import channel_credentials, make_certificates

# 20 steps a round: the tiny base's held-out loss is still falling steeply, so each round lowers it by a wide margin
# (measured on the 64 examples below: 6.10 -> 2.85 -> 2.03; at 60 steps it flattens, 6.10 -> 1.91 -> 1.83)
STEPS = os.environ.get("ZOO_GYM_E2E_STEPS", "20")
DATABASES = ("sqlite", "postgresql")  # the whole module runs on each (tests/conftest.py)


def _client(root: Path, name: str, port: int, rounds: int, shard: int) -> subprocess.Popen:
    return client(root, name, port, rounds=rounds, steps=STEPS, shard=shard)


@pytest.fixture(scope="module")
def federation(tmp_path_factory, db_backend, new_database):
    root = tmp_path_factory.mktemp("federation")
    state_dir = root / "server"
    db_url = new_database(db_backend)
    subprocess.run(_server("init", "--state-dir", str(state_dir), "--base-model", "tiny",
                           *(["--db", db_url] if db_url else [])), check=True, env=ENV, capture_output=True)
    port_file = root / "port"
    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))
    server = subprocess.Popen(_server("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                                      str(port_file), "--min-contributors", "3", "--round-timeout", "900",
                                      "--client-lr-decay", "1",
                                      "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)),
                              stderr=open(root / "server.log", "w"), env=ENV)
    port = _wait(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                 timeout=120, what="the server to listen", procs=[server])
    yield {"root": root, "state_dir": state_dir, "port": port, "server": server, "ca": tls.ca}
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def two_rounds(federation):
    root, port, state_dir = federation["root"], federation["port"], federation["state_dir"]
    a, b = _client(root, "A", port, 2, 0), _client(root, "B", port, 2, 1)
    c = _client(root, "C", port, 1, 2)
    procs = [a, b, c, federation["server"]]
    clients = [a, b, c]
    try:
        _wait(lambda: open_round(port, federation["ca"]) > 1  # round 1 closed: then ask `gym-server status`
              and any(r["id"] == 1 and r["state"] == "published" for r in _status(state_dir)["rounds"]),
              timeout=900, what="round 1 to be published", procs=procs)
        clients.append(_client(root, "D", port, 1, 3))  # joins late: must enter round 2
        outputs = {}
        for name, p in zip("ABCD", clients):
            out, _ = p.communicate(timeout=900)
            assert p.returncode == 0, (root / name / "client.log").read_text()[-3000:]
            outputs[name] = json.loads(out)
    finally:  # a failure must not leave clients retrying a server that is gone
        for p in clients:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return {"status": _status(state_dir), "clients": outputs}


def test_two_rounds_publish_better_checkpoints(federation, two_rounds, tmp_path):
    from transformers import AutoModelForCausalLM

    from zoo_gym.gym_train import default_validation_examples, heldout_loss

    status = two_rounds["status"]
    ckpts = {c["round"]: c for c in status["checkpoints"]}
    assert sorted(ckpts) == [0, 1, 2]
    examples = default_validation_examples(n=64)
    losses = []
    for r in (0, 1, 2):
        assert ckpts[r]["parent_sha256"] == (ckpts[r - 1]["sha256"] if r else None)
        blob = federation["state_dir"] / "blobs" / "sha256" / ckpts[r]["sha256"][:2] / ckpts[r]["sha256"]
        model_dir = archive.unpack(blob, tmp_path / f"ckpt{r}")
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # a standard Hugging Face directory
        assert model.num_parameters() > 0
        losses.append(heldout_loss(model_dir, examples))
    assert losses[1] < losses[0] and losses[2] < losses[1], losses
    lineage = ckpts[2]["lineage"]
    assert lineage["round"] == 2 and lineage["parent_sha256"] == ckpts[1]["sha256"]


def test_late_joiner_enters_the_next_round(two_rounds):
    clients = two_rounds["clients"]
    rounds_of = {name: [s["round"] for s in summaries] for name, summaries in clients.items()}
    assert rounds_of == {"A": [1, 2], "B": [1, 2], "C": [1], "D": [2]}
    by_round = {r["id"]: set(r["report"]["soup"]["contributors"][i]["contributor"]
                             for i in range(len(r["report"]["soup"]["contributors"])))
                for r in two_rounds["status"]["rounds"] if r["state"] == "published"}
    ids = {name: summaries[0]["contributor"] for name, summaries in clients.items()}
    assert by_round[1] == {ids["A"], ids["B"], ids["C"]}
    assert by_round[2] == {ids["A"], ids["B"], ids["D"]}


def _channel(federation) -> grpc.Channel:
    return grpc.secure_channel(f"127.0.0.1:{federation['port']}", channel_credentials(federation["ca"]))


def test_round_2_trains_at_the_servers_scheduled_learning_rate(two_rounds):
    """--client-lr-decay 1: round r asks for lr / r in its signed RoundInfo, and every contributor trains at it,
    a newcomer too (D joins in round 2: the schedule is the federation's, not the client's)."""
    clients = two_rounds["clients"]
    first = clients["A"][0]["learning_rate"]
    assert first > 0 and clients["C"][0]["learning_rate"] == first
    assert [s["learning_rate"] for s in clients["A"]] == pytest.approx([first, first / 2])
    assert clients["B"][1]["learning_rate"] == clients["D"][0]["learning_rate"] == pytest.approx(first / 2)


def test_stale_base_is_refused_and_not_stored(federation, two_rounds):
    channel = _channel(federation)
    stub = gym_pb2_grpc.GymStub(channel)
    key = Ed25519PrivateKey.generate()
    cid = stub.Register(register_request(key, "stale")).contributor_id
    info = stub.GetRound(gym_pb2.GetRoundRequest())
    genesis = next(c for c in two_rounds["status"]["checkpoints"] if c["round"] == 0)["sha256"]
    assert info.base_sha256 != genesis
    name = "model.layers.0.self_attn.q_proj.weight"
    from safetensors import safe_open

    model_dir = archive.unpack(federation["state_dir"] / "blobs" / "sha256" / genesis[:2] / genesis,
                               federation["root"] / "genesis")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        shape = f.get_slice(name).get_shape()
    import torch

    payload = codec.encode({name: torch.full(shape, 1e-3)}, codec="fp16")
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=genesis,
                          payload=payload, metadata={})
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "download the current base" in err.value.details()
    after = stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=cid))
    assert after.submissions == 0 and not after.you_submitted
    assert not (federation["state_dir"] / "blobs" / "sha256" / codec.sha256_hex(payload)[:2]
                / codec.sha256_hex(payload)).exists()
    channel.close()


class _RecordingStub:
    """The real stub, recording the offsets the client asks for."""

    def __init__(self, stub):
        self._stub = stub
        self.offsets: list[int] = []

    def DownloadCheckpoint(self, request, **kw):  # noqa: N802 - gRPC naming
        self.offsets.append(request.offset)
        return self._stub.DownloadCheckpoint(request, **kw)


def test_interrupted_download_resumes(federation, two_rounds, tmp_path):
    channel = _channel(federation)
    stub = _RecordingStub(gym_pb2_grpc.GymStub(channel))
    info = stub._stub.GetRound(gym_pb2.GetRoundRequest())
    # Interrupt a download after its first chunks, as a dropped connection would.
    (tmp_path / "downloads").mkdir()
    partial = tmp_path / "downloads" / f"{info.base_sha256}.partial"
    with open(partial, "wb") as f:
        for chunk in stub._stub.DownloadCheckpoint(gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256)):
            f.write(chunk.data)
            if f.tell() >= info.base_size // 2:
                break
    have = partial.stat().st_size
    assert 0 < have < info.base_size
    model_dir = fetch_checkpoint(stub, info.base_sha256, info.base_size, tmp_path, progress=False)
    assert stub.offsets == [have]  # resumed where it stopped, not from 0
    assert (model_dir / "model.safetensors").is_file() and not partial.exists()
    channel.close()


def test_ledger_verifies_and_balances_match(federation, two_rounds):
    state_dir, root = federation["state_dir"], federation["root"]
    out = subprocess.run(_server("ledger", "verify", "--state-dir", str(state_dir)), capture_output=True,
                         text=True, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    rewards = [sys.executable, "-m", "zoo_gym.client", "rewards", "--server", f"127.0.0.1:{federation['port']}",
               "--key", str(root / "A" / "key.pem"), "--json", "--verify"]
    plain = subprocess.run([*rewards, "--insecure"], capture_output=True, text=True, env=ENV, timeout=60)
    assert plain.returncode == 1 and "serves TLS" in plain.stderr  # refused at once, in one line
    res = subprocess.run([*rewards, "--root-certificates", str(federation["ca"])], capture_output=True, text=True,
                         env=ENV)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["verification"]["ok"] and doc["entries"] == 2
    assert doc["balance"] == doc["sum_of_entries"]
