"""A channel to gym-server with retries: an unreachable or busy server is retried with backoff, and said so.

`Servers` is one federation at several addresses (its `gym-server serve` and `gym-server ingest` processes):
each contributor starts at the address its key picks (`spread`), and a call that finds its address
unavailable moves it to the next one, where `with_retries` repeats the call.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from zoo_gym.proto import gym_pb2_grpc
from zoo_gym.proto.busy import is_busy

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
FAILOVER = RETRYABLE  # an address whose call failed so moves its contributor to the next one
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
                 base_delay: float = 0.5, max_delay: float = 15.0, first_contact: bool = True) -> T:
    """Run `call`; on UNAVAILABLE/DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED marked "server busy" (the server is
    at capacity, proto/busy.py), retry with jittered exponential backoff up to `max_wait` s. Other
    RESOURCE_EXHAUSTED answers (a payload or chunk over a limit) are raised at once: no retry can fix them.
    `first_contact` False: the server answered before, so a closed socket is a server gone (retried), never a
    TLS mismatch."""
    deadline = time.monotonic() + max_wait
    delay = base_delay
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            busy = is_busy(exc)
            if exc.code() not in RETRYABLE and not busy:
                raise
            problem = transport_mismatch(exc) if first_contact else None
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


def addresses(servers: str) -> list[str]:
    """The addresses of a `--server` value: one HOST:PORT, or several separated by commas (blanks dropped)."""
    return [a.strip() for a in servers.split(",") if a.strip()]


def spread(public_key: bytes, n: int) -> int:
    """Which of `n` addresses a contributor starts at: a hash of its public key, so contributors spread evenly
    over the addresses and each one keeps its own from run to run."""
    digest = hashlib.sha256(b"zoo-gym/server-choice\n" + public_key).digest()
    return int.from_bytes(digest[:8], "big") % n


class _Watched:
    """A server-streaming call's responses; an error while reading them is shown to `failed` first."""

    def __init__(self, call, failed: Callable[[grpc.RpcError], None]) -> None:
        self._call, self._failed = call, failed

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            self._failed(exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class Servers:
    """A GymStub over the addresses of one federation, one channel each (opened on first use). Calls go to the
    current address, first `addresses[start]`; one that fails UNAVAILABLE or DEADLINE_EXCEEDED moves the
    current address to the next (said once) and is raised as it was, so the caller's `with_retries` sends it
    again, to the next address. Every address must serve the same federation: the caller checks what each
    answers against the one pinned server key. `close()` closes every channel."""

    def __init__(self, addresses: list[str], *, start: int = 0, root_certificates: str | None = None,
                 insecure: bool = False, say: Callable[[str], None] = lambda _m: None) -> None:
        if not addresses:
            raise ValueError("no server address")
        self.addresses = list(addresses)
        self.index = start % len(self.addresses)
        self._open = lambda address: open_stub(address, root_certificates=root_certificates, insecure=insecure)
        self._say = say
        self._lock = threading.Lock()
        self._stubs: dict[int, tuple[grpc.Channel, Any]] = {}

    @property
    def address(self) -> str:
        return self.addresses[self.index]

    def _stub(self, i: int):
        with self._lock:
            if i not in self._stubs:
                self._stubs[i] = self._open(self.addresses[i])
            return self._stubs[i][1]

    def _failed(self, i: int, exc: grpc.RpcError) -> None:
        if len(self.addresses) < 2 or exc.code() not in FAILOVER:
            return
        with self._lock:
            if self.index != i:  # another call moved on already
                return
            self.index = (i + 1) % len(self.addresses)
        self._say(f"{self.addresses[i]} answered {exc.code().name}: going on with {self.address}")

    def __getattr__(self, method: str):
        if not method[:1].isupper():  # the RPCs: Register, GetRound, SubmitDelta, ...
            raise AttributeError(method)

        def call(*args, **kwargs):
            i = self.index
            try:
                result = getattr(self._stub(i), method)(*args, **kwargs)
            except grpc.RpcError as exc:
                self._failed(i, exc)
                raise
            return _Watched(result, lambda exc: self._failed(i, exc)) if hasattr(result, "__next__") else result

        return call

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
