"""Several `gym-server ingest` processes beside one `gym-server serve`, on PostgreSQL (issue 50 item 4).

Real processes over TLS sharing one state directory and one database: two ingest processes take a round's
uploads from real `gym-client join` processes, spread over both addresses by their keys, and serve publishes the
round; every address signs the same RoundInfo. One ingest process SIGKILLed after acknowledgements, with an
upload in flight and a join process's upload still to come: every acknowledged submission is in the published
round, the half-written upload is not, and the killed process's clients go on at the other address. A
submission waiting for the database's advisory write lock while the round closes is refused and stores nothing.
Ingest A serves its own /metrics, which count what it took. The refusals (SQLite, an uninitialised directory, no
serve yet, a round setting other than serve's) are one line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from e2e_processes import ENV, client, server_cmd, status, stop, tls_server, wait_for
from zoo_gym import codec
from zoo_gym.client.connection import Servers, open_stub, spread, with_retries
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.proto import gym_pb2, signing

CONFIG = "min_contributors = {n}\nround_timeout = 900\nmax_chunk_bytes = 65536\n"


def _keys(n_addresses: int, picks: list[int]) -> list[Ed25519PrivateKey]:
    """Fixed keys, the i-th one starting at address picks[i] (connection.spread)."""
    out, seed = [], 1
    for want in picks:
        while True:  # bounded: each address is picked by about 1 / n_addresses of the seeds
            assert seed < 256, "no key picks the address wanted"
            key = Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)
            seed += 1
            if spread(signing.public_bytes(key), n_addresses) == want:
                out.append(key)
                break
    return out


def _key_file(root: Path, name: str, key: Ed25519PrivateKey) -> None:
    (root / name).mkdir(exist_ok=True)
    (root / name / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))


def _ingest(root: Path, name: str, state_dir: Path, db: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """`gym-server ingest` over TLS with the federation's certificate (stderr in root/<name>.log), once it listens."""
    port_file = root / f"{name}.port"
    tls = root / "tls"
    proc = subprocess.Popen(server_cmd("ingest", "--state-dir", str(state_dir), "--db", db, "--port", "0",
                                       "--port-file", str(port_file), "--ssl-certfile", str(tls / "server.pem"),
                                       "--ssl-keyfile", str(tls / "server.key"), *extra),
                            stderr=open(root / f"{name}.log", "w"), env=ENV)
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=120, what=f"ingest process {name} to listen", procs=[proc])
    except BaseException:
        stop([proc])
        raise
    return proc, port


@pytest.fixture
def federation(tmp_path, new_database):
    """serve (min_contributors 4) and two ingest processes, A and B, on one state directory and database."""
    db = new_database("postgresql")
    state_dir, serve, port = tls_server(tmp_path, CONFIG.format(n=4), db=db)
    procs = [serve]
    try:
        dash_a = _free_port()
        a, port_a = _ingest(tmp_path, "ingest-a", state_dir, db, "--dashboard-port", str(dash_a))
        procs.append(a)
        b, port_b = _ingest(tmp_path, "ingest-b", state_dir, db)
        procs.append(b)
        yield {"root": tmp_path, "state_dir": state_dir, "db": db, "serve": (serve, port), "a": (a, port_a),
               "b": (b, port_b), "ca": str(tmp_path / "tls" / "ca.pem"), "procs": procs, "dash_a": dash_a}
    finally:
        stop(procs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(port: int, ca: str) -> dict[tuple[str, tuple], float]:
    """An ingest process's /metrics (its dashboard is on TLS with the federation's certificate), parsed."""
    context = ssl.create_default_context(cafile=ca)
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=30, context=context) as r:
        text = r.read().decode()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text) for x in family.samples}


def _payload(seed: int) -> bytes:
    """A small fp16 delta of the tiny base (a few hundred KB: several upload chunks)."""
    g = torch.Generator().manual_seed(seed)
    with safe_open(str(tiny_model_dir() / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = sorted(k for k in shapes if k.endswith("mlp.up_proj.weight"))
    return codec.encode({k: torch.randn(shapes[k], generator=g) * 1e-3 for k in names}, codec="fp16")


def _register_and_header(stub, key, payload: bytes):
    cid = stub.Register(register_request(key, "ingest-test"), timeout=30).contributor_id
    info = stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30)
    return cid, build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                             payload=payload, metadata={})


def _round_one(state_dir: Path) -> dict:
    """status --json once round 1 is published."""
    doc = wait_for(lambda: (d := status(state_dir))["rounds"][0]["state"] == "published" and d, timeout=300,
                   what="round 1 to be published")
    return doc


def _published(state_dir: Path, db: str) -> dict:
    """Round 1's submissions, the ledger, and the blobs no row references, read from the store."""
    from sqlmodel import select

    from zoo_gym.server.rounds.settlement import ledger_entries
    from zoo_gym.server.store.checkpoint_writer import master_sha256
    from zoo_gym.server.store.models import Checkpoint, Submission
    from zoo_gym.server.store.queries import verify_ledger
    from zoo_gym.server.store.state import open_state

    state = open_state(state_dir, db_url=db)
    try:
        with state.session() as s:
            subs = list(s.exec(select(Submission).where(Submission.round_id == 1)))
            checkpoints = list(s.exec(select(Checkpoint)))
            referenced = {x.payload_sha256 for x in s.exec(select(Submission))} | {c.sha256 for c in checkpoints} | {
                master_sha256(c.manifest_json) for c in checkpoints}
        stored = {p.name for p in (state.blobs.root / "sha256").rglob("*") if p.is_file()}
        return {"subs": {x.contributor_id: x.payload_sha256 for x in subs}, "n": len(subs),
                "entries": sorted(e["contributor_id"] for e in ledger_entries(state, contributor=None, since_seq=0,
                                                                              limit=None) if e["round_id"] == 1),
                "verified": verify_ledger(state)["ok"], "orphans": stored - referenced}
    finally:
        state.engine.dispose()


def _signed_round(address: str, ca: str) -> bytes:
    channel, stub = open_stub(address, root_certificates=ca)
    try:
        return stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30).SerializeToString()
    finally:
        channel.close()


def test_two_ingest_processes_take_a_round_that_serve_publishes(federation):
    root, state_dir = federation["root"], federation["state_dir"]
    addr_a, addr_b = (f"127.0.0.1:{federation[x][1]}" for x in ("a", "b"))
    names = ["c0", "c1", "c2", "c3"]
    for name, key in zip(names, _keys(2, [0, 1, 0, 1])):  # two start at A, two at B
        _key_file(root, name, key)
    joins = [client(root, name, f"{addr_a},{addr_b}", rounds=1, steps=8, shard=i) for i, name in enumerate(names)]
    try:
        for p in joins:
            assert p.wait(timeout=600) == 0, (root / names[joins.index(p)] / "client.log").read_text()[-2000:]
    finally:
        stop(joins)
    assert _round_one(state_dir)["checkpoints"][-1]["round"] == 1
    took = {x: (root / f"ingest-{x}.log").read_text().count("submission accepted") for x in ("a", "b")}
    assert took == {"a": 2, "b": 2}
    m = _metrics(federation["dash_a"], federation["ca"])  # ingest A's own /metrics counts what A took
    assert m[("zoo_gym_submissions_accepted_total", ())] == 2
    assert m[("zoo_gym_rpcs_total", (("code", "OK"), ("method", "SubmitDelta")))] == 2
    assert m[("zoo_gym_received_bytes_total", ())] > 0 and m[("process_resident_memory_bytes", ())] > 0
    for i, name in enumerate(names):
        log = (root / name / "client.log").read_text()
        assert f"registered at {(addr_a, addr_b)[i % 2]}" in log
    got = _published(state_dir, federation["db"])
    assert got["n"] == 4 and got["verified"] and len(got["entries"]) == 4 and got["orphans"] == set()
    # one federation at three addresses: the same signed RoundInfo, byte for byte
    serve_addr = f"127.0.0.1:{federation['serve'][1]}"
    assert _signed_round(addr_a, federation["ca"]) == _signed_round(addr_b, federation["ca"]) == \
        _signed_round(serve_addr, federation["ca"])


class _InFlight:
    """An upload as gym-client join sends it after registering (with_retries, first_contact False) to the
    `addresses`: the first attempt stalls after its header and first chunk (`sent` then set) until its address
    fails, the retries send the whole stream. `answer()` is the SubmitResponse (or the error) once taken; `said`
    what the client said meanwhile."""

    def __init__(self, addresses: list[str], ca: str, header, payload: bytes) -> None:
        self.said, self.sent = [], threading.Event()
        self.servers = Servers(addresses, root_certificates=ca, say=self.said.append)
        self._lost, self._done, self._result = threading.Event(), threading.Event(), None
        self._stream = lambda: request_stream(header, payload, chunk_bytes=1 << 14)
        self._attempts = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _first(self):
        messages = list(self._stream())
        yield from messages[:2]
        self.sent.set()
        self._lost.wait(timeout=120)  # bounded; the call fails when its address dies
        yield from messages[2:]

    def _send(self):
        self._attempts += 1
        if self._attempts > 1:
            self._lost.set()
        stream = self._first() if self._attempts == 1 else self._stream()
        return self.servers.SubmitDelta(stream, timeout=120)

    def _run(self) -> None:
        try:
            self._result = with_retries(self._send, what="upload", say=self.said.append, max_wait=180,
                                        first_contact=False)
        except Exception as exc:  # noqa: BLE001 - handed to answer()
            self._result = exc
        finally:
            self._lost.set()
            self._done.set()
            self.servers.close()

    def answer(self):
        assert self._done.wait(timeout=240), "the upload neither answered nor failed"
        if isinstance(self._result, Exception):
            raise self._result
        return self._result


def _staged(root: Path, pid: int) -> list[Path]:
    """The upload files an ingest process `pid` is staging (blobs/ingest-tmp/<pid>-*/)."""
    return [p for d in (root / "server" / "blobs" / "ingest-tmp").glob(f"{pid}-*") for p in d.glob("blob-*")
            if p.stat().st_size > 0]


def test_a_killed_ingest_process_loses_no_acknowledged_submission(federation):
    root, state_dir, ca = federation["root"], federation["state_dir"], federation["ca"]
    (proc_a, port_a), (_, port_b) = federation["a"], federation["b"]
    addr_a, addr_b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
    k1, k2, k3, k4 = _keys(2, [0, 0, 0, 0])  # all four start at A
    payloads = [_payload(i) for i in range(3)]
    channel, stub = open_stub(addr_a, root_certificates=ca)
    acked = {}
    for key, payload in zip((k1, k2), payloads):  # acknowledged by A
        cid, header = _register_and_header(stub, key, payload)
        acked[cid] = stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 14), timeout=60).payload_sha256
    _key_file(root, "c4", k4)  # a join process at A, stopped while it trains
    join = client(root, "c4", f"{addr_a},{addr_b}", rounds=1, steps=8, shard=3)
    try:
        wait_for(lambda: "training (" in (root / "c4" / "client.log").read_text(), timeout=300,
                 what="the join process to train", procs=[join], poll=0.1)
        join.send_signal(signal.SIGSTOP)
        cid3, header = _register_and_header(stub, k3, payloads[2])
        upload = _InFlight([addr_a, addr_b], ca, header, payloads[2])
        assert upload.sent.wait(timeout=60)
        wait_for(lambda: _staged(root, proc_a.pid), timeout=60, what="A to stage the upload", poll=0.1)
        proc_a.send_signal(signal.SIGKILL)  # after two acknowledgements, with an upload in flight
        assert proc_a.wait(timeout=60) == -signal.SIGKILL
        join.send_signal(signal.SIGCONT)  # its upload goes to A, which is gone: it must go on at B
        resp = upload.answer()
        assert resp.payload_sha256 == header.payload_sha256 and upload.servers.address == addr_b
        assert upload.said[0] == f"{addr_a} answered UNAVAILABLE: going on with {addr_b}"
        acked[cid3] = resp.payload_sha256
        assert join.wait(timeout=600) == 0, (root / "c4" / "client.log").read_text()[-2000:]
    finally:
        if join.poll() is None:
            join.send_signal(signal.SIGCONT)
        stop([join])
        channel.close()
    log4 = (root / "c4" / "client.log").read_text()
    assert f"registered at {addr_a}" in log4 and f"going on with {addr_b}" in log4
    _round_one(state_dir)
    got = _published(state_dir, federation["db"])
    assert got["n"] == 4 and all(got["subs"][cid] == sha for cid, sha in acked.items())  # every acknowledgement
    assert sorted(got["subs"]) == got["entries"] and got["verified"]  # one ledger entry each, the chain intact
    assert got["orphans"] == set()  # the half-written upload never became a blob
    assert _staged(root, proc_a.pid)  # its staging file is still there, never counted ...
    again, _ = _ingest(root, "ingest-a2", state_dir, federation["db"])  # ... until the next ingest process starts
    federation["procs"].append(again)
    assert not list((state_dir / "blobs" / "ingest-tmp").glob(f"{proc_a.pid}-*"))


def test_a_submission_waiting_for_the_write_lock_is_refused_once_the_round_closed(tmp_path, new_database):
    """The round-open check and the row's insert happen under the database's advisory lock: a submission that
    waits for it while the round is closed (the test holds the lock and closes the round, as serve's round
    manager would) is refused FAILED_PRECONDITION and stores nothing."""
    import psycopg

    from zoo_gym.server.store.state import WRITE_LOCK_KEY

    db = new_database("postgresql")
    state_dir, serve, _ = tls_server(tmp_path, CONFIG.format(n=4), db=db)
    stop([serve])  # it wrote serve.json; no round manager runs from here on
    ingest, port = _ingest(tmp_path, "ingest", state_dir, db)
    channel, stub = open_stub(f"127.0.0.1:{port}", root_certificates=str(tmp_path / "tls" / "ca.pem"))
    try:
        payload = _payload(7)
        _, header = _register_and_header(stub, Ed25519PrivateKey.from_private_bytes(bytes([9]) * 32), payload)
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (WRITE_LOCK_KEY,))
            upload = stub.SubmitDelta.future(request_stream(header, payload, chunk_bytes=1 << 14), timeout=120)
            wait_for(lambda: conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT "
                                          "granted").fetchone()[0] == 1, timeout=60, poll=0.1,
                     what="the submission to wait for the write lock")
            _close_round_one(state_dir, db)  # as the round manager does, which would hold the lock
            conn.execute("SELECT pg_advisory_unlock(%s)", (WRITE_LOCK_KEY,))
        with pytest.raises(grpc.RpcError) as refused:
            upload.result(timeout=120)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM submission").fetchone()[0] == 0
        assert not (state_dir / "blobs" / "sha256" / header.payload_sha256[:2] / header.payload_sha256).exists()
        assert not [p for p in (state_dir / "blobs" / "ingest-tmp").rglob("blob-*")]
    finally:
        channel.close()
        stop([ingest])


def test_the_server_wide_registration_limit_holds_across_ingest_processes(tmp_path, new_database):
    """serve allows 2 uninvited new keys in any 4 minutes. Before, each ingest process kept its own bucket, so
    two addresses let in twice that; now the third new key is refused at either address, nothing of it stored,
    and a key already registered still passes."""
    import psycopg

    db = new_database("postgresql")
    config = CONFIG.format(n=4) + "register_burst_global = 2\nregister_rate_global = 0.5\n"
    state_dir, serve, _ = tls_server(tmp_path, config, db=db)
    procs = [serve]
    stubs = []
    try:
        for name in ("a", "b"):
            proc, port = _ingest(tmp_path, f"ingest-{name}", state_dir, db)
            procs.append(proc)
            stubs.append(open_stub(f"127.0.0.1:{port}", root_certificates=str(tmp_path / "tls" / "ca.pem")))
        (_, a), (_, b) = stubs
        first = Ed25519PrivateKey.generate()
        assert a.Register(register_request(first, "one"), timeout=30).created
        assert b.Register(register_request(Ed25519PrivateKey.generate(), "two"), timeout=30).created
        with pytest.raises(grpc.RpcError) as refused:
            a.Register(register_request(Ed25519PrivateKey.generate(), "three"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(all its addresses): try again in" in refused.value.details()
        again = b.Register(register_request(first, "one"), timeout=30)  # a known key is never limited
        assert not again.created and again.contributor_id
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM contributor").fetchone()[0] == 2
    finally:
        for channel, _ in stubs:
            channel.close()
        stop(procs)


def _close_round_one(state_dir: Path, db: str) -> None:
    from zoo_gym.server.store.models import Round, RoundState
    from zoo_gym.server.store.state import open_state

    state = open_state(state_dir, db_url=db)
    try:
        with state.session() as s:
            rnd = s.get(Round, 1)
            rnd.state = RoundState.AGGREGATING
            s.add(rnd)
            s.commit()
    finally:
        state.engine.dispose()


def _refusal(*args: str) -> str:
    done = subprocess.run(server_cmd("ingest", *args, "--insecure", "--port", "0"), capture_output=True, text=True,
                          env=ENV, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


def test_ingest_refuses_in_one_line(tmp_path, new_database):
    line = _refusal("--state-dir", str(tmp_path / "nothing"))
    assert "is not a gym-server state directory" in line and "gym-server init" in line
    sqlite_dir = tmp_path / "sqlite"
    subprocess.run(server_cmd("init", "--state-dir", str(sqlite_dir), "--base-model", "tiny"), check=True, env=ENV,
                   capture_output=True)
    line = _refusal("--state-dir", str(sqlite_dir))
    assert "needs PostgreSQL" in line and "--db postgresql://" in line
    db = new_database("postgresql")
    pg_dir = tmp_path / "pg"
    subprocess.run(server_cmd("init", "--state-dir", str(pg_dir), "--base-model", "tiny", "--db", db), check=True,
                   env=ENV, capture_output=True)
    line = _refusal("--state-dir", str(pg_dir))
    assert "no gym-server serve has run" in line and "start it first" in line
    (pg_dir / "serve.json").write_text(json.dumps({"settings": {"min_contributors": 4}}))  # as serve records it
    (tmp_path / "fed.toml").write_text("min_contributors = 2\n")
    line = _refusal("--state-dir", str(pg_dir), "--config", str(tmp_path / "fed.toml"))
    assert "`min_contributors` is 2 here but 4 in the running gym-server serve" in line
