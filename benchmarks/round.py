"""Round overhead and loopback transfer throughput of gym-server. Prints one JSON document.

1. Round overhead: n contributors' BitDelta deltas of the tiny model are stored in a real server state;
   we time the server's AGGREGATING -> PUBLISHED step (publish_round: decode, DeltaSoup, apply, save,
   pack, store; rewards scoring and held-out evaluation timed separately) against the bare work of
   reading the same deltas (decode every tensor) and writing the same checkpoint (save_file + tar +
   fsync), measured in the same run. Target: ratio <= 2.
2. Transfer: a 256 MiB checkpoint downloaded and a 256 MiB delta uploaded over 127.0.0.1 through the
   real gRPC service (upload time includes the server's validation and fsync before it acknowledges).
   Target: >= 300 MB/s each way.

    python benchmarks/round.py [--contributors 10] [--transfer-mib 256] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file
from sqlmodel import select

from zoo_gym import codec
from zoo_gym.client.download import fetch_checkpoint
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import archive, gym_pb2, gym_pb2_grpc, signing
from zoo_gym.server.config import build_config
from zoo_gym.server.store.models import Contributor, Round, Submission
from zoo_gym.server.rounds.publish import publish_round
from zoo_gym.server.transport.servicer import build_server
from zoo_gym.server.genesis import init_state


def _store_submissions(state, n: int, seed: int = 0) -> list[Submission]:
    with state.session() as s:
        rnd = s.get(Round, 1)
    base = load_file(str(state.checkpoint_dir(rnd.base_sha256) / archive.WEIGHTS))
    g = torch.Generator().manual_seed(seed)
    subs = []
    with state.session() as s:
        for i in range(n):
            delta = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in base.items()}
            payload = codec.encode(delta, codec="bitdelta", group_size=128)
            with state.blobs.writer() as w:
                w.write(payload)
                sha = w.commit()
            cid = f"{i:032x}"
            s.add(Contributor(id=cid, public_key="00" * 32))
            sub = Submission(round_id=1, contributor_id=cid, base_sha256=rnd.base_sha256, payload_sha256=sha,
                             payload_size=len(payload), codecs="bitdelta")
            s.add(sub)
            subs.append(sub)
        s.commit()
        return list(s.exec(select(Submission).where(Submission.round_id == 1)))


def _bare(state, subs, base_sha: str, out_dir: Path) -> float:
    """Read every delta tensor and write the checkpoint: the I/O floor of a round."""
    base_dir = state.checkpoint_dir(base_sha)
    t0 = time.perf_counter()
    base = load_file(str(base_dir / archive.WEIGHTS))
    acc = {k: v.clone() for k, v in base.items()}
    for sub in subs:
        with open(state.blobs.path(sub.payload_sha256), "rb") as f, \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for name, t in codec.decode(m).items():
                acc[name] += t.reshape(acc[name].shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(acc, str(out_dir / archive.WEIGHTS), metadata={"format": "pt"})
    for p in base_dir.iterdir():
        if p.name != archive.WEIGHTS:
            shutil.copyfile(p, out_dir / p.name)
    with state.blobs.writer() as w:
        archive.pack(out_dir, w)
        w.commit()
    return time.perf_counter() - t0


def round_overhead(n: int, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    state = init_state(root / "state", base_model="tiny")
    subs = _store_submissions(state, n)
    with state.session() as s:
        rnd = s.get(Round, 1)
    bare = min(_bare(state, subs, rnd.base_sha256, root / f"bare{i}") for i in range(3))
    # Aggregation + publishing alone (no rewards, no evaluation): the pure server path.
    cfg = build_config({}, aggregator="mean")
    bare_cfg = build_config({}, aggregator="mean", validation_examples=0)  # no evaluator: no scoring, no settlement
    t0 = time.perf_counter()
    publish_round(state, bare_cfg, rnd, subs)
    publish_only = time.perf_counter() - t0
    state.engine.dispose()
    # The whole round as served: + held-out evaluation and rewards scoring.
    state2 = init_state(root / "state2", base_model="tiny")
    subs2 = _store_submissions(state2, n)
    with state2.session() as s:
        rnd2 = s.get(Round, 1)
    t0 = time.perf_counter()
    publish_round(state2, cfg, rnd2, subs2)
    full = time.perf_counter() - t0
    state2.engine.dispose()
    return {"contributors": n, "bare_read_write_s": bare, "publish_s": publish_only,
            "round_overhead_ratio": publish_only / bare, "publish_with_scoring_s": full,
            "with_scoring_ratio": full / bare, "target_ratio_max": 2.0}


def transfer(mib: int, root: Path) -> dict:
    model_dir = root / "big"
    model_dir.mkdir(parents=True)
    side = int((mib * (1 << 20) / 4) ** 0.5)
    big = {"model.big.weight": torch.randn(side, side) * 0.02}
    save_file(big, str(model_dir / archive.WEIGHTS), metadata={"format": "pt"})
    state = init_state(root / "tstate", base_model=str(model_dir))
    cfg = build_config({}, port=0, insecure=True, max_payload_bytes=4 * mib << 20, max_chunk_bytes=4 << 20,
                       download_chunk_bytes=4 << 20)
    server, port, rounds = build_server(state, cfg)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20),
                                                                  ("grpc.max_send_message_length", 64 << 20)])
    stub = gym_pb2_grpc.GymStub(channel)
    try:
        info = stub.GetRound(gym_pb2.GetRoundRequest())
        t0 = time.perf_counter()
        received = sum(len(c.data) for c in stub.DownloadCheckpoint(
            gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256)))
        stream = time.perf_counter() - t0
        assert received == info.base_size
        t0 = time.perf_counter()
        fetch_checkpoint(stub, info.base_sha256, info.base_size, root / "client", progress=False)
        down = time.perf_counter() - t0
        os.sync()  # start the upload with no writeback of the download's 512 MB still pending
        key = Ed25519PrivateKey.generate()
        cid = stub.Register(register_request(key, "bench")).contributor_id
        payload = codec.encode({"model.big.weight": torch.randn(side, side) * 1e-3}, codec="fp32")
        header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                              payload=payload, metadata={})
        t0 = time.perf_counter()
        stub.SubmitDelta(request_stream(header, payload, chunk_bytes=4 << 20))
        up = time.perf_counter() - t0
        # The server's validation alone (decode + finite + norm) on the same payload, to separate it out.
        from zoo_gym.server.transport import handlers

        h = handlers.SubmitHeader(contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                                  payload_sha256=header.payload_sha256, payload_size=len(payload),
                                  manifest=tuple((t.name, tuple(t.shape), t.dtype, t.codec) for t in header.manifest),
                                  nonce=header.nonce, signature=header.signature, metadata_json="{}")
        base_m = handlers.base_manifest(state, info.base_sha256)
        t0 = time.perf_counter()
        handlers._check_payload(payload, h, base_m, cfg)  # noqa: SLF001 - measuring the step itself
        validate = time.perf_counter() - t0
        # Transport alone: the same servicer and stream, with a handler that only hashes what arrives
        # (then refuses), to separate gRPC streaming from the server's durable-and-validated storage.
        from zoo_gym.server import errors as server_errors

        real = handlers.submit_delta

        def hash_only(header, chunks, *, state, config):
            h = hashlib.sha256()
            for c in chunks:
                h.update(c)
            raise server_errors.InvalidArgument(f"probe: {h.hexdigest()}")

        handlers.submit_delta = hash_only
        t0 = time.perf_counter()
        try:
            stub.SubmitDelta(request_stream(header, payload, chunk_bytes=4 << 20))
        except grpc.RpcError as exc:
            assert codec.sha256_hex(payload) in exc.details()
        stream_up = time.perf_counter() - t0
        handlers.submit_delta = real
    finally:
        channel.close()
        server.stop(grace=None)
        state.engine.dispose()
    mb = 1e6
    return {"checkpoint_bytes": info.base_size,
            "download_stream_MBps": info.base_size / stream / mb,
            "download_fetch_MBps": info.base_size / down / mb,
            "download_fetch_includes": "streaming + incremental sha256 + write + untar into the cache",
            "payload_bytes": len(payload),
            "upload_stream_MBps": len(payload) / stream_up / mb,
            "upload_stream_includes": "gRPC client stream + server sha256 only (no storage, no validation)",
            "upload_MBps": len(payload) / up / mb,
            "upload_includes": "streaming + server sha256 + write + decode/finite/norm validation + fsync + commit",
            "server_validation_s": validate,
            "upload_without_validation_MBps": len(payload) / max(up - validate, 1e-9) / mb,
            "target_MBps_min": 300}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contributors", type=int, default=10)
    ap.add_argument("--transfer-mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="3 contributors, 32 MiB transfer")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.contributors, args.transfer_mib = 3, 32
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
               "round": round_overhead(args.contributors, root / "r"),
               "transfer": transfer(args.transfer_mib, root / "t")}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
