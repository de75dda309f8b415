"""An in-process gym-server (the real service and state, on 127.0.0.1 and a free port) for service tests.
Tests that run it as a process share server_processes.py (this folder goes on the path: --import-mode=importlib)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors import safe_open

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import gym_pb2, gym_pb2_grpc, signing
from zoo_gym.server.config import build_config
from zoo_gym.server.transport.servicer import build_server
from zoo_gym.server.genesis import init_state

sys.path.insert(0, str(Path(__file__).parent))


class Federation:
    def __init__(self, state, config, server, port, rounds):
        self.state, self.config, self.server, self.port, self.rounds = state, config, server, port, rounds
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = gym_pb2_grpc.GymStub(self.channel)

    def round(self, cid: str = "") -> gym_pb2.RoundInfo:
        return self.stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=cid))

    def register(self, key=None):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = key or Ed25519PrivateKey.generate()
        resp = self.stub.Register(register_request(key, "test"))
        return key, resp.contributor_id

    def base_shapes(self) -> dict[str, tuple[int, ...]]:
        info = self.round()
        path = self.state.checkpoint_dir(info.base_sha256) / "model.safetensors"
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def small_delta(self, seed: int = 0, scale: float = 1e-3, names: int = 3) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shapes = self.base_shapes()
        chosen = [k for k, s in shapes.items() if len(s) == 2][:names]
        return {k: torch.randn(shapes[k], generator=g) * scale for k in chosen}

    def submit(self, key, cid, payload: bytes, *, round_id=None, base_sha256=None, nonce=None, header=None,
               chunk=1 << 16):
        info = self.round()
        header = header or build_header(key=key, contributor_id=cid, round_id=round_id or info.round_id,
                                        base_sha256=base_sha256 or info.base_sha256, payload=payload,
                                        metadata={"test": True}, nonce=nonce)
        return self.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=chunk))

    def stored_submissions(self) -> int:
        from sqlmodel import func, select

        from zoo_gym.server.store.models import Submission

        with self.state.session() as s:
            return int(s.exec(select(func.count()).select_from(Submission)).one())

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)
        self.rounds.stop()
        self.state.engine.dispose()

    def wait_published(self, round_id: int, timeout: float = 180.0):
        """The round's row once it is PUBLISHED; AssertionError when it halts or the timeout passes."""
        from zoo_gym.server.store.models import Round, RoundState

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.state.session() as s:
                r = s.get(Round, round_id)
                if r is not None and r.state == RoundState.PUBLISHED:
                    return r
                if r is not None and r.state == RoundState.HALTED:
                    raise AssertionError(f"round {round_id} halted: {r.message}")
            time.sleep(0.2)
        raise AssertionError(f"round {round_id} was not published within {timeout} s")

    def blob_count(self) -> int:
        return sum(1 for p in (self.state.blobs.root / "sha256").rglob("*") if p.is_file())


def start_federation(state_dir, db_url=None, *, validation_file=None, **overrides) -> Federation:
    """A real in-process server on 127.0.0.1:0 over a new state directory; `overrides` are config flags.
    `db_url`: the database (None: the directory's SQLite file; see tests/conftest.py); `validation_file`: the
    server's validation set (None: the tiny base's default)."""
    state = init_state(state_dir, base_model="tiny", db_url=db_url, validation_file=validation_file)
    flags = dict(port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600, max_payload_bytes=4 << 20,
                 max_chunk_bytes=1 << 20)
    config = build_config({}, **{**flags, **overrides})
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    return Federation(state, config, server, port, rounds)


@pytest.fixture
def federation(tmp_path, db_url):
    fed = start_federation(tmp_path / "state", db_url)
    yield fed
    fed.stop()


@pytest.fixture
def federation_with(tmp_path, db_backend, new_database):
    """`federation_with(**flags)`: a federation with other settings (stopped after the test)."""
    started: list[Federation] = []

    def start(validation_file=None, **overrides) -> Federation:
        started.append(start_federation(tmp_path / f"state{len(started)}", new_database(db_backend),
                                        validation_file=validation_file, **overrides))
        return started[-1]

    yield start
    for fed in started:
        fed.stop()


@pytest.fixture
def sign():
    return signing
