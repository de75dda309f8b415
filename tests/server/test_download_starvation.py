"""Downloads that are never read cannot starve the server either (issue 14 item 4).

grpcio's synchronous server sends a server-streamed message and then waits, on its pool thread and with
no time limit, until the peer's flow-control window takes it. A client that opens DownloadCheckpoint (or
StreamLedger) and never reads used to hold that thread for as long as it kept the connection open, so
enough of them took the whole pool and health checks queued behind them. Now a download takes a slot
without waiting (past `max_downloads`: "server busy" at once) and one whose reader takes nothing for
`download_idle_timeout` seconds is cancelled, handing its thread and slot back.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.proto.busy import is_busy
from zoo_gym.server.store.models import Checkpoint

BIG = 48 << 20  # far past what HTTP/2 flow control lets a reader that takes nothing buffer


def _big_checkpoint(fed) -> str:
    """A published checkpoint large enough that its download blocks on a reader that takes nothing."""
    with fed.state.blobs.writer() as w:
        for _ in range(BIG >> 20):
            w.write(os.urandom(1 << 20))
        sha = w.commit()
    with fed.state.session() as s:
        s.add(Checkpoint(sha256=sha, round_id=99, size=BIG))
        s.commit()
    return sha


def _unread_download(channel, sha: str):
    """Open a download and never read it: the server's sends pile up until its window is full."""
    call = gym_pb2_grpc.GymStub(channel).DownloadCheckpoint(
        gym_pb2.DownloadRequest(checkpoint_sha256=sha, offset=0), timeout=120)
    return call


def test_unread_downloads_are_bounded_and_cannot_starve_health_or_get_round(federation_with):
    fed = federation_with(max_downloads=4, download_idle_timeout=60.0)
    sha = _big_checkpoint(fed)
    health = health_pb2_grpc.HealthStub(fed.channel)
    channels = [grpc.insecure_channel(f"127.0.0.1:{fed.port}") for _ in range(4)]
    calls = []
    try:
        # Enough unread downloads to take every thread of the pool as it was (uploads + pending + queries).
        n = fed.config.max_uploads + fed.config.max_pending_headers + fed.config.query_workers + 8
        for i in range(n):
            calls.append(_unread_download(channels[i % len(channels)], sha))
        time.sleep(2.0)  # let the server start sending and block
        t = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        fed.stub.GetRound(gym_pb2.GetRoundRequest(), timeout=5)
        assert time.perf_counter() - t < 5.0  # typically ms; a starved pool would wait out the 60 s idle timeout
        # Past the bound the answer is "server busy" at once, which a client retries.
        refused = 0
        for call in calls:
            try:
                next(call)
            except grpc.RpcError as exc:
                if is_busy(exc):
                    refused += 1
                    continue
                raise
        assert refused == n - 4
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


def test_a_download_whose_reader_takes_nothing_is_cancelled_and_its_slot_handed_back(federation_with):
    # The idle timeout is far above the time the busy check below takes even on a loaded CI machine (it
    # was 1.5 s with a 1 s sleep, and a slow second connect once saw the slot already handed back).
    idle = 5.0
    fed = federation_with(max_downloads=1, download_idle_timeout=idle)
    sha = _big_checkpoint(fed)
    channel = grpc.insecure_channel(f"127.0.0.1:{fed.port}")
    stalled = _unread_download(channel, sha)
    try:
        first = next(stalled)  # read one chunk, then nothing
        assert first.offset == 0
        read_at = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{fed.port}") as other:
            try:
                next(_unread_download(other, sha))
                raise AssertionError("a second download fit past max_downloads=1 "
                                     f"({time.monotonic() - read_at:.1f} s after the first chunk, idle {idle} s)")
            except grpc.RpcError as exc:
                assert is_busy(exc), exc
        # After the idle timeout the stalled download is cancelled and its slot is free again.
        deadline = time.monotonic() + 30
        while True:
            with grpc.insecure_channel(f"127.0.0.1:{fed.port}") as other:
                try:
                    chunk = next(_unread_download(other, sha))
                    assert chunk.offset == 0
                    break
                except grpc.RpcError as exc:
                    assert is_busy(exc), exc
            assert time.monotonic() < deadline, "the stalled download kept its slot"
            time.sleep(0.5)
        done = threading.Event()

        def drain():
            try:
                for _ in stalled:
                    pass
            except grpc.RpcError:
                done.set()

        threading.Thread(target=drain, daemon=True).start()
        assert done.wait(10), "the stalled download should have ended with an error (cancelled)"
    finally:
        stalled.cancel()
        channel.close()


def test_a_complete_download_still_works_and_matches_its_sha(federation_with):
    import hashlib

    fed = federation_with(max_downloads=1, download_idle_timeout=5.0)
    info = fed.round()
    digest = hashlib.sha256()
    for chunk in fed.stub.DownloadCheckpoint(gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256)):
        digest.update(chunk.data)
    assert digest.hexdigest() == info.base_sha256
    # and again: the slot was handed back
    n = sum(len(c.data) for c in fed.stub.DownloadCheckpoint(gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256)))
    assert n == info.base_size
