"""A man in the middle between a real `gym-client join` and a real `gym-server` (issue 14 item 2).

The proxy is a gRPC server with a generic handler that forwards every call's raw bytes to the real server
(identity serializers) and rewrites one thing on the way back: the RoundInfo's base_sha256 (the message
re-encoded), or one byte of a checkpoint chunk. The client must refuse with a clear one-line error and a
non-zero exit, and the real server must hold no submission from it. TLS is not what is tested here: the
proxy speaks plaintext to both sides (`--insecure`), which is exactly what a TLS-less path would give an
attacker.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent import futures
from contextlib import closing
from pathlib import Path

import grpc
import pytest

from zoo_gym.proto import gym_pb2

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SERVICE = gym_pb2.DESCRIPTOR.services_by_name["Gym"]

pytestmark = pytest.mark.slow


class RewritingProxy(grpc.GenericRpcHandler):
    """Forwards every Gym call to `upstream` byte for byte, except what `rewrite` is set to change:
    "round" (GetRound's base_sha256) or "chunk" (one byte of the first DownloadCheckpoint chunk)."""

    def __init__(self, upstream: str, rewrite: str) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.rewrite = rewrite
        self.rewritten = 0
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.rewritten += 1

    def _round(self, raw: bytes) -> bytes:
        info = gym_pb2.RoundInfo.FromString(raw)
        info.base_sha256 = "e" * 64  # the attacker's base; the signature still is the server's original
        self._count()
        return info.SerializeToString()

    def _chunks(self, responses):
        first = True
        for raw in responses:
            if first:
                chunk = gym_pb2.CheckpointChunk.FromString(raw)
                data = bytearray(chunk.data)
                data[len(data) // 2] ^= 0xFF
                chunk.data = bytes(data)
                raw, first = chunk.SerializeToString(), False
                self._count()
            yield raw

    def service(self, handler_call_details):
        path = handler_call_details.method
        name = path.rsplit("/", 1)[-1]
        method = SERVICE.methods_by_name.get(name)
        if method is None or not path.startswith(f"/{SERVICE.full_name}/"):
            return None
        self.calls.append(name)

        def forward_error(exc: grpc.RpcError, context):
            context.abort(exc.code(), exc.details() or "")

        if method.client_streaming:
            call = self.channel.stream_unary(path)

            def stream_unary(request_iterator, context):
                try:
                    return call(request_iterator, timeout=600)
                except grpc.RpcError as exc:
                    forward_error(exc, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if method.server_streaming:
            call = self.channel.unary_stream(path)

            def unary_stream(request, context):
                try:
                    responses = call(request, timeout=600)
                    if name == "DownloadCheckpoint" and self.rewrite == "chunk":
                        responses = self._chunks(responses)
                    yield from responses
                except grpc.RpcError as exc:
                    forward_error(exc, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)
        call = self.channel.unary_unary(path)

        def unary_unary(request, context):
            try:
                response = call(request, timeout=60)
            except grpc.RpcError as exc:
                forward_error(exc, context)
            if name == "GetRound" and self.rewrite == "round":
                response = self._round(response)
            return response

        return grpc.unary_unary_rpc_method_handler(unary_unary)


def _start_proxy(upstream: str, rewrite: str):
    proxy = RewritingProxy(upstream, rewrite)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 80 << 20),
                                  ("grpc.max_send_message_length", 80 << 20)])
    server.add_generic_rpc_handlers((proxy,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return proxy, server, port


def _server(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.server", *args]


def _wait_for_port(port_file: Path, proc: subprocess.Popen, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        assert proc.poll() is None, f"gym-server exited with {proc.returncode}"
        time.sleep(0.5)
    raise AssertionError("gym-server did not listen in time")


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mitm")
    state_dir = root / "server"
    subprocess.run(_server("init", "--state-dir", str(state_dir), "--base-model", "tiny"), check=True, env=ENV,
                   capture_output=True)
    port_file = root / "port"
    proc = subprocess.Popen(_server("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                                    str(port_file), "--insecure", "--min-contributors", "3",
                                    "--round-timeout", "900"),
                            stderr=open(root / "server.log", "w"), env=ENV)
    try:
        yield {"state_dir": state_dir, "port": _wait_for_port(port_file, proc), "root": root}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _submissions(state_dir: Path) -> int:
    """Submissions the real server stored (read-only, beside the running server)."""
    with closing(sqlite3.connect(f"file:{state_dir / 'server.db'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT count(*) FROM submission").fetchone()[0]


@pytest.mark.parametrize("rewrite, refusal", [
    ("round", "is not signed by the server's pinned key"),
    ("chunk", "failed verification"),
])
def test_client_refuses_a_rewritten_round_or_chunk_and_submits_nothing(real_server, tmp_path, rewrite, refusal):
    proxy, proxy_server, proxy_port = _start_proxy(f"127.0.0.1:{real_server['port']}", rewrite)
    try:
        cmd = [sys.executable, "-m", "zoo_gym.client", "join", "--server", f"127.0.0.1:{proxy_port}", "--insecure",
               "--rounds", "1", "--max-steps", "8", "--threads", "1", "--workdir", str(tmp_path / "work"),
               "--key", str(tmp_path / "key.pem"), "--no-wait", "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    finally:
        proxy_server.stop(grace=None)
        proxy.channel.close()
    assert proxy.rewritten >= 1, f"the proxy never saw the call to rewrite: {proxy.calls}; {done.stderr[-3000:]}"
    assert done.returncode != 0, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert refusal in last and "Traceback" not in done.stderr, done.stderr
    assert "SubmitDelta" not in proxy.calls
    assert _submissions(real_server["state_dir"]) == 0
