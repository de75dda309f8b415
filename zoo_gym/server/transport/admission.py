"""Who may register: limits against Sybil bursts, and operator-signed single-use invitations.

A new identity (a key not yet registered; a registered one passes and writes nothing) takes a token from its
peer's bucket (`register_*_per_peer`; empty: RESOURCE_EXHAUSTED with the wait) and, registering uninvited, meets
the server-wide limit every process of the database shares (`shared_wait`: at most `register_burst_global` in any
burst / `register_rate_global` minutes). A peer is `context.peer()` without its port, an IPv6 peer its /64;
peer buckets live in each process's memory (a restart refills them), at most `MAX_PEERS`, the least recently
used dropped first. With `admission = "invite"` a new key
must instead spend an invitation from `gym-server invite` (a genuine one takes no token, a missing or
forged one does): base64url (no padding) of a 16-byte random id and the server's Ed25519 signature over
``INVITE_DOMAIN + id``, recorded as spent (`SpentInvite`) in the transaction that registers the key, so
each admits exactly one key. Why: docs/design/transport.md."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import os
import threading
import time
from collections import OrderedDict
from datetime import datetime, timezone
from collections.abc import Callable
from urllib.parse import unquote

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym.proto import signing
from zoo_gym.server.errors import InvalidArgument, PermissionDenied, ResourceExhausted

ADMISSION_MODES = ("open", "invite")
INVITE_DOMAIN = b"zoo-gym/invite/v1\n"  # never a prefix of another signed kind (see zoo_gym/proto/signing.py)
INVITE_ID_BYTES = 16
INVITE_CHARS = math.ceil((INVITE_ID_BYTES + 64) * 4 / 3)  # base64url of id + signature, unpadded: 107
MAX_PEERS = 65536


class TokenBucket:
    """`burst` tokens at most, refilled at `per_minute` tokens a minute; times are monotonic seconds."""

    def __init__(self, *, per_minute: float, burst: int, now: float) -> None:
        self.rate = per_minute / 60.0  # tokens per second
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def wait(self, now: float) -> float:
        """Seconds until a token is available (0.0: one is)."""
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate

    def take(self) -> None:
        self.tokens -= 1.0


def peer_address(peer: str) -> str:
    """The part of a gRPC peer string that identifies the host: "ipv4:1.2.3.4:5678" -> "1.2.3.4",
    "ipv6:[2001:db8::1]:5678" -> "2001:db8::/64"; anything else (a unix socket) whole, without a port."""
    kind, _, rest = unquote(peer or "").partition(":")
    host = rest.rpartition(":")[0].strip("[]") if kind in ("ipv4", "ipv6") else rest
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{kind}:{host}"
    if ip.version == 6 and ip.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


class RegistrationLimiter:
    """Token buckets for new identities, one per peer address, in this process; and the server-wide limit's
    settings (`global_per_minute`, `global_burst`), which `shared_wait` applies over the database. Thread-safe."""

    def __init__(self, *, per_peer_per_minute: float, per_peer_burst: int, global_per_minute: float,
                 global_burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._per_peer = (per_peer_per_minute, per_peer_burst)
        self.global_per_minute, self.global_burst = global_per_minute, global_burst
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, peer: str) -> None:
        """Take one token from `peer`'s bucket, or raise ResourceExhausted naming the wait."""
        who = peer_address(peer)
        with self._lock:
            now = self._clock()
            bucket = self._peers.pop(who, None)
            if bucket is None:
                rate, burst = self._per_peer
                bucket = TokenBucket(per_minute=rate, burst=burst, now=now)
            self._peers[who] = bucket  # most recently used last
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
            wait = bucket.wait(now)
            if wait > 0:
                raise ResourceExhausted(f"too many new contributors registered from {who} recently: try again in "
                                        f"{math.ceil(wait)} s (an already registered key is never limited)")
            bucket.take()


def shared_wait(recent: list[datetime], *, per_minute: float, burst: int, now: datetime) -> float:
    """Seconds until one more uninvited key may register (0.0: it may now), given the registration times of the
    latest `burst` uninvited keys (`recent`, any order): at most `burst` in any `burst / per_minute` minutes.
    The caller reads `recent` in the write session that adds the key, which every process of the database
    takes in turn, so the limit holds across ingest processes, not per process.

    A sliding window rather than a bucket, because a bucket's level is state that each process would keep
    apart (N processes: N times the rate); the window's state is the contributor rows every process reads."""
    if len(recent) < burst:
        return 0.0
    window = burst / per_minute * 60.0
    oldest = min(_utc(t) for t in recent)
    return max(0.0, window - (now - oldest).total_seconds())


def _utc(t: datetime) -> datetime:
    """SQLite returns the stored UTC times without their zone; PostgreSQL with it."""
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t


# ----------------------------------------------------------------------------------------------- invites

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_invites(key: Ed25519PrivateKey, *, count: int) -> list[str]:
    """`count` fresh single-use invitations signed with the server's key."""
    tokens = []
    for _ in range(count):
        invite_id = os.urandom(INVITE_ID_BYTES)
        tokens.append(_b64(invite_id + signing.sign(key, INVITE_DOMAIN + invite_id)))
    return tokens


def invite_id(token: str, *, server_public_key: bytes) -> str:
    """The hex id of a genuine invitation of this server; PermissionDenied for anything else."""
    if len(token) > 4 * INVITE_CHARS:
        raise InvalidArgument(f"invite is {len(token)} characters; a `gym-server invite` token has {INVITE_CHARS}")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError):
        raw = b""
    ident, signature = raw[:INVITE_ID_BYTES], raw[INVITE_ID_BYTES:]
    try:
        if len(raw) != INVITE_ID_BYTES + 64:
            raise signing.SignatureError("wrong length")
        signing.verify(server_public_key, signature, INVITE_DOMAIN + ident)
    except signing.SignatureError:
        raise PermissionDenied("this invite is not one this server's operator signed (mistyped, or for another "
                               "server?); ask the operator for an invite (`gym-server invite`)") from None
    return ident.hex()


class Admission:
    """The server's admission policy: the configured mode, the registration buckets, the server key."""

    def __init__(self, *, mode: str, limiter: RegistrationLimiter, server_public_key: bytes) -> None:
        if mode not in ADMISSION_MODES:
            raise ValueError(f"`admission` must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")
        self.mode = mode
        self.limiter = limiter
        self.server_public_key = server_public_key

    @classmethod
    def from_config(cls, config, *, server_public_key: bytes) -> Admission:
        limiter = RegistrationLimiter(per_peer_per_minute=config.register_rate_per_peer,
                                      per_peer_burst=config.register_burst_per_peer,
                                      global_per_minute=config.register_rate_global,
                                      global_burst=config.register_burst_global)
        return cls(mode=config.admission, limiter=limiter, server_public_key=server_public_key)

    def admit_new(self, *, peer: str, invite: str) -> str | None:
        """Check a NEW key may register. Open mode: a token from the buckets. Invite mode: a genuine invitation
        admits without a token (the operator planned that population: 10,000 invited keys from one address get
        in, where the buckets would pass 20 and then 10 a minute); anything else takes a token, so a burst of
        uninvited keys is RESOURCE_EXHAUSTED past the burst, and is refused PERMISSION_DENIED before that.
        Returns the invitation id to spend with the registration (None in open mode)."""
        if self.mode == "open":
            self.limiter.admit(peer)
            return None
        try:
            if not invite:
                raise PermissionDenied("this server admits new contributors by invitation only: ask the operator "
                                       "for an invite (`gym-server invite`) and join with --invite TOKEN")
            return invite_id(invite, server_public_key=self.server_public_key)
        except (PermissionDenied, InvalidArgument):
            self.limiter.admit(peer)  # an uninvited burst still meets the buckets
            raise
