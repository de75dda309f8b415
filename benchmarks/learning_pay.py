"""Pay against contribution on the real base (part of benchmarks/learning.py).

A real gym-server (the service and its state, in this process, on 127.0.0.1) over the real base, with
held-out arithmetic questions as its validation set (the state's file, as `serve` reads it), its default rule,
and rewards scored as `flags` say (`gym-server serve`'s settings: --scoring-metric, --scoring-subsets, ...). Its
one round takes signed uploads of: the benchmark's honest round-1 contributors, honest contributors whose labels
are partly wrong (their data helps less), and free riders: a zero delta, a random delta of the honest RMS, and a
copy of contributor 0's payload under another key. What the server pays each is read from its round report.
Ground truth (learning.py): each submission's leave-one-out gain in held-out exact match under the same rule.
"""

from __future__ import annotations

import json
import pathlib
import time

import torch


def _serve(base_dir: pathlib.Path, work: pathlib.Path, validation: list[dict], n: int, flags: dict):
    from zoo_gym.server.config import build_config
    from zoo_gym.server.genesis import init_state
    from zoo_gym.server.transport.servicer import build_server

    work.mkdir(parents=True, exist_ok=True)
    vfile = work / "validation.jsonl"
    vfile.write_text("".join(json.dumps(ex) + "\n" for ex in validation))
    state = init_state(work / "state", base_model=str(base_dir), validation_file=vfile)
    config = build_config({}, port=0, insecure=True, min_contributors=n, round_timeout=3600,
                          max_payload_bytes=1 << 30, max_chunk_bytes=4 << 20, **flags)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    return state, server, port, rounds


def _submit_all(port: int, payloads: list[bytes]) -> tuple[list[str], list[str | None]]:
    """Register a key per payload and upload it signed; (contributor ids, the server's refusal or None)."""
    import grpc
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from zoo_gym.client.upload import build_header, register_request, request_stream
    from zoo_gym.proto import gym_pb2, gym_pb2_grpc

    ids, refused = [], []
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = gym_pb2_grpc.GymStub(ch)
        info = stub.GetRound(gym_pb2.GetRoundRequest())
        for i, payload in enumerate(payloads):
            key = Ed25519PrivateKey.generate()
            cid = stub.Register(register_request(key, f"bench-{i}")).contributor_id
            header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                                  payload=payload, metadata={"benchmark": "learning"})
            try:
                stub.SubmitDelta(request_stream(header, payload, chunk_bytes=4 << 20))
                refused.append(None)
            except grpc.RpcError as err:
                refused.append(f"{err.code().name}: {err.details()}")
            ids.append(cid)
    return ids, refused


def _wait_report(state, round_id: int, timeout: float) -> dict:
    from zoo_gym.server.store.models import Round, RoundState

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with state.session() as s:
            r = s.get(Round, round_id)
            if r is not None and r.state == RoundState.PUBLISHED:
                return json.loads(r.report_json)
            if r is not None and r.state == RoundState.HALTED:
                raise RuntimeError(f"round {round_id} halted: {r.message}")
        time.sleep(1.0)
    raise RuntimeError(f"round {round_id} was not published within {timeout:.0f} s")


def server_pay(base_dir: pathlib.Path, work: pathlib.Path, validation: list[dict], payloads: list[bytes], *,
               flags: dict) -> tuple[list[int], list[dict], list[str | None], str]:
    """What the real server pays each payload of one round (amounts in submission order), its scores, and
    its refusals at upload, and the scoring method its report names. The round closes when every payload that is not all zeros is in (the server
    refuses a zero delta at upload; a payload it refuses otherwise would leave the round waiting: an error)."""
    from zoo_gym import codec

    nonzero = sum(any(bool(t.any()) for t in codec.decode(p).values()) for p in payloads)
    state, server, port, rounds = _serve(base_dir, work, validation, nonzero, flags)
    try:
        ids, refused = _submit_all(port, payloads)
        report = _wait_report(state, 1, timeout=7200)
    finally:
        server.stop(grace=None)
        rounds.stop()
        state.engine.dispose()
    paid = {p["contributor"]: int(p["amount"]) for p in report["rewards"].get("payouts", [])}
    scores = {s["contributor"]: s for s in report["rewards"].get("scores", [])}
    return ([paid.get(c, 0) for c in ids], [scores.get(c, {}) for c in ids], refused,
            report["rewards"].get("method", ""))


def payload_of(delta: dict[str, torch.Tensor]) -> bytes:
    from zoo_gym import codec

    return codec.encode(delta, codec="auto", group_size=128)
