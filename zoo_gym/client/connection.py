"""A channel to gym-server with retries: an unreachable or busy server is retried with backoff, and said so."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from zoo_gym.proto import gym_pb2_grpc
from zoo_gym.proto.busy import is_busy

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MiB = 1 << 20


class ServerUnreachable(RuntimeError):
    """The server did not answer within the retry budget."""


class ServerBusy(ServerUnreachable):
    """The server kept answering "server busy" (RESOURCE_EXHAUSTED at capacity) for the whole retry budget."""


class TransportMismatch(ServerUnreachable):
    """Client and server disagree on TLS (plaintext against TLS, or an untrusted certificate): retrying
    cannot help, so it is said at once."""


def open_stub(address: str, *, root_certificates: str | None = None,
              insecure: bool = False) -> tuple[grpc.Channel, gym_pb2_grpc.GymStub]:
    """A channel to gym-server: TLS verified against `root_certificates` (PEM file; the system trust store
    when None), or plaintext only when `insecure` is asked for explicitly."""
    options = [
        ("grpc.max_receive_message_length", 80 * MiB),
        ("grpc.max_send_message_length", 80 * MiB),
    ]
    if insecure:
        channel = grpc.insecure_channel(address, options=options)
    else:
        from zoo_gym.proto.tls import channel_credentials

        channel = grpc.secure_channel(address, channel_credentials(root_certificates), options=options)
    return channel, gym_pb2_grpc.GymStub(channel)


def transport_mismatch(exc: grpc.RpcError) -> str | None:
    """What to fix when a call failed because client and server disagree on TLS; None for other failures."""
    details = exc.details() or ""
    if "WRONG_VERSION_NUMBER" in details:
        return ("the server does not speak TLS (it runs with --insecure): pass --insecure to connect in "
                "plaintext, on a network you trust")
    if "Tls handshake failed" in details or "Peer name" in details or "CERTIFICATE_VERIFY_FAILED" in details:
        return ("the server's TLS certificate does not verify: pass --root-certificates with the federation's "
                "CA certificate, and connect by a host name or address the certificate names")
    if "Socket closed" in details:
        return ("the server closed the connection during setup: it serves TLS, so drop --insecure (and pass "
                "--root-certificates if its certificate comes from a private CA)")
    return None


def with_retries(call: Callable[[], T], *, what: str, say: Callable[[str], None], max_wait: float = 300.0,
                 base_delay: float = 0.5, max_delay: float = 15.0) -> T:
    """Run `call`; on UNAVAILABLE/DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED marked "server busy" (the server is
    at capacity, proto/busy.py), retry with jittered exponential backoff up to `max_wait` s. Other
    RESOURCE_EXHAUSTED answers (a payload or chunk over a limit) are raised at once: no retry can fix them."""
    deadline = time.monotonic() + max_wait
    delay = base_delay
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            busy = is_busy(exc)
            if exc.code() not in RETRYABLE and not busy:
                raise
            problem = transport_mismatch(exc)
            if problem:
                raise TransportMismatch(f"{what}: cannot connect securely: {problem}") from exc
            left = deadline - time.monotonic()
            if left <= 0 and busy:
                raise ServerBusy(f"{what}: {exc.details()}; gave up after {max_wait:.0f} s") from exc
            if left <= 0:
                raise ServerUnreachable(f"{what}: the server is unreachable ({exc.details()}); gave up after "
                                        f"{max_wait:.0f} s") from exc
            wait = min(delay * (1 + random.random() * 0.25), max_delay, left)
            say(f"{what}: the server is busy, retrying in {wait:.1f} s ({exc.details()})" if busy else
                f"{what}: server unreachable ({exc.code().name}); retrying in {wait:.1f} s")
            time.sleep(wait)
            delay = min(delay * 2, max_delay)
