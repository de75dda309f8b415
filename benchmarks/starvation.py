"""Health and GetRound latency of a real `gym-server` (TLS) under stalled upload streams (issue 14 item 4).

Starts `gym-server serve` on 127.0.0.1 with its defaults, measures health checks and GetRound idle, then
while 200 SubmitDelta streams and 100 GetRound calls from another peer address (127.0.0.2, through a
relay) send nothing and 20 registered contributors' streams send a signed header and stall; then times
one legitimate submission.
The stream helpers are the ones tests/server/test_starvation.py uses. Prints one JSON document.

    python benchmarks/starvation.py [--probes 50] [--silent 200] [--silent-unary 100] [--stalled 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.proto.tls import channel_credentials, make_certificates

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from test_starvation import OtherAddress, _probe, _refused_busy, _stalled, _stalled_upload  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Remote:
    """What the stream helpers need of a federation: a stub and the current round."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = gym_pb2_grpc.GymStub(channel)

    def round(self) -> gym_pb2.RoundInfo:
        return self.stub.GetRound(gym_pb2.GetRoundRequest(), timeout=10)


def _figures(seconds: list[float]) -> dict:
    return {"max_ms": round(max(seconds) * 1e3, 2), "median_ms": round(statistics.median(seconds) * 1e3, 2),
            "n": len(seconds)}


def _payload() -> bytes:
    """A small valid fp16 delta for the tiny base (`--base-model tiny`): 1e-4 on its first two matrices."""
    import torch
    from safetensors import safe_open

    from zoo_gym.gym_train import tiny_model_dir

    with safe_open(str(tiny_model_dir() / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = [k for k, s in shapes.items() if len(s) == 2][:2]
    return codec.encode({k: torch.full(shapes[k], 1e-4) for k in names}, codec="fp16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--silent", type=int, default=200)
    ap.add_argument("--silent-unary", type=int, default=100)
    ap.add_argument("--stalled", type=int, default=20)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="starvation-"))
    state_dir, port_file = root / "server", root / "port"
    server_cmd = [sys.executable, "-m", "zoo_gym.server"]
    subprocess.run([*server_cmd, "init", "--state-dir", str(state_dir), "--base-model", "tiny"], check=True, env=ENV,
                   capture_output=True)
    tls = make_certificates(root / "tls", hosts=("127.0.0.1",))
    server = subprocess.Popen([*server_cmd, "serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                               str(port_file), "--min-contributors", "100", "--register-burst-per-peer", "500",
                               "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)],
                              stderr=open(root / "server.log", "w"), env=ENV)
    stop = threading.Event()
    calls, relay = [], None
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.2)
        port = int(port_file.read_text())
        creds = channel_credentials(str(tls.ca))
        channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
        remote = Remote(channel)
        health = health_pb2_grpc.HealthStub(channel)
        check = lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # noqa: E731
        get_round = lambda: remote.stub.GetRound(gym_pb2.GetRoundRequest(), timeout=10)  # noqa: E731
        grpc.channel_ready_future(channel).result(timeout=60)
        idle = {"health": _figures(_probe(check, args.probes)), "get_round": _figures(_probe(get_round, args.probes))}

        payload = _payload()
        keys = [Ed25519PrivateKey.generate() for _ in range(args.stalled + 1)]
        cids = [remote.stub.Register(register_request(k, "bench"), timeout=10).contributor_id for k in keys]
        calls += [_stalled_upload(remote, stop, k, c, payload) for k, c in zip(keys[:-1], cids[:-1])]
        relay = OtherAddress(port)
        attacker_channel = grpc.secure_channel(f"127.0.0.1:{relay.port}", creds)
        attacker = gym_pb2_grpc.GymStub(attacker_channel)
        silent = [attacker.SubmitDelta.future(_stalled(stop), timeout=300) for _ in range(args.silent)]
        open_get_round = attacker_channel.stream_unary(  # a GetRound whose request message never comes
            "/zoo_gym.v1.Gym/GetRound", request_serializer=gym_pb2.GetRoundRequest.SerializeToString,
            response_deserializer=gym_pb2.RoundInfo.FromString)
        silent_unary = [open_get_round.future(_stalled(stop), timeout=300) for _ in range(args.silent_unary)]
        calls += silent + silent_unary
        time.sleep(2.0)
        refused = sum(_refused_busy(f) for f in silent + silent_unary)
        under = {"health": _figures(_probe(check, args.probes)), "get_round": _figures(_probe(get_round, args.probes))}
        still_open = sum(not f.done() for f in calls)

        info = remote.round()
        header = build_header(key=keys[-1], contributor_id=cids[-1], round_id=info.round_id,
                              base_sha256=info.base_sha256, payload=payload, metadata={})
        t = time.perf_counter()
        resp = remote.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 20), timeout=60)
        submit_s = time.perf_counter() - t
        print(json.dumps({
            "benchmark": "starvation", "server": "gym-server serve (TLS, defaults: --max-uploads 32, "
                                                 "--max-pending-headers 64 / 8 per address, --header-timeout 10)",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "idle": idle,
            "attack": {"silent_streams": args.silent, "silent_unary_calls": args.silent_unary,
                       "silent_refused_busy_at_once": refused,
                       "stalled_signed_streams": args.stalled, "streams_still_open_during_probes": still_open},
            "under_attack": under,
            "legitimate_submission": {"seconds": round(submit_s, 3), "ok": resp.payload_sha256 == codec.sha256_hex(payload),
                                      "payload_bytes": len(payload)},
        }, indent=2))
    finally:
        stop.set()
        for f in calls:
            f.cancel()
        if relay is not None:
            relay.close()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
