"""A refused upload leaves nothing behind: no blob, no temporary file, whatever stage refused it.

Issue 12 item 2: a refusal decided at the final check under the write lock (a twin upload won the
race, or the round closed mid-stream) used to keep its blob for good, so one key could fill the disk.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from zoo_gym import codec
from zoo_gym.client.upload import build_header
from zoo_gym.proto import gym_pb2

DATABASES = ("sqlite", "postgresql")  # the federation runs on each (tests/conftest.py)


def _stored_files(federation) -> tuple[int, int]:
    """(files in the content-addressed store, files in its temporary directory)."""
    blobs = federation.state.blobs
    return federation.blob_count(), sum(1 for p in blobs.tmp_dir.iterdir())


def _referenced(federation) -> set[str]:
    from sqlmodel import select

    from zoo_gym.server.store.models import Checkpoint, Submission

    with federation.state.session() as s:
        return ({x.payload_sha256 for x in s.exec(select(Submission))}
                | {c.sha256 for c in s.exec(select(Checkpoint))})


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _paused_upload(federation, key, cid, *, seed: int, release: threading.Event):
    """Start an upload that sends its header and 1 KiB, then waits for `release`; once the server holds its
    temporary file, return (its future, the payload's sha256)."""
    payload = codec.encode(federation.small_delta(seed=seed, names=6), codec="fp16")
    info = federation.round()
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                          payload=payload, metadata={})

    def paused():
        yield gym_pb2.SubmitRequest(header=header)
        yield gym_pb2.SubmitRequest(chunk=payload[:1024])
        release.wait(timeout=60)
        yield gym_pb2.SubmitRequest(chunk=payload[1024:])

    future = federation.stub.SubmitDelta.future(paused())
    _wait(lambda: _stored_files(federation)[1] == 1)  # the upload's temporary file exists
    return future, codec.sha256_hex(payload)


@pytest.mark.parametrize("trial", range(3))
def test_concurrent_uploads_from_one_key_leave_only_the_accepted_blob(federation, trial):
    key, cid = federation.register()
    payloads = [codec.encode(federation.small_delta(seed=10 * trial + i, names=6), codec="fp16") for i in range(4)]
    before, _ = _stored_files(federation)
    start = threading.Barrier(len(payloads))

    def send(payload):
        start.wait(timeout=30)
        try:
            federation.submit(key, cid, payload, chunk=1 << 12)  # many small chunks: uploads overlap
            return "OK"
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(len(payloads)) as pool:
        outcomes = list(pool.map(send, payloads))
    assert outcomes.count("OK") == 1, outcomes
    assert set(outcomes) - {"OK"} <= {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
    after, tmp = _stored_files(federation)
    assert after == before + 1 and tmp == 0  # only the accepted payload is stored: 0 bytes of the refused
    assert federation.stored_submissions() == 1
    stored = {p.name for p in (federation.state.blobs.root / "sha256").rglob("*") if p.is_file()}
    assert stored <= _referenced(federation)


def test_a_second_upload_while_one_is_in_flight_is_refused_before_any_byte_is_stored(federation):
    key, cid = federation.register()
    release = threading.Event()
    first, _ = _paused_upload(federation, key, cid, seed=1, release=release)
    other = codec.encode(federation.small_delta(seed=2, names=6), codec="fp16")
    with pytest.raises(grpc.RpcError) as info:
        federation.submit(key, cid, other)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "in progress" in info.value.details()
    release.set()
    assert first.result(timeout=60).submissions == 1
    assert federation.stored_submissions() == 1 and _stored_files(federation)[1] == 0


def test_an_upload_that_finishes_after_the_round_closed_keeps_no_blob(federation):
    late_key, late_cid = federation.register()
    release = threading.Event()
    pending, late_sha = _paused_upload(federation, late_key, late_cid, seed=3, release=release)
    for seed in (4, 5):  # min_contributors = 2: these close the round while the late upload waits
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    _wait(lambda: federation.round().round_id == 2, timeout=120)
    release.set()
    with pytest.raises(grpc.RpcError) as refused:
        pending.result(timeout=60)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert not federation.state.blobs.exists(late_sha)
    assert _stored_files(federation)[1] == 0
    stored = {p.name for p in (federation.state.blobs.root / "sha256").rglob("*") if p.is_file()}
    assert stored <= _referenced(federation)
