"""The servers a client trusts, pinned per address like ssh's `known_hosts`.

One file, `known_servers` beside the contributor key (or the pull cache), or `$ZOO_GYM_KNOWN_SERVERS`;
mode 0600, one line per server address: ``ADDRESS SERVER_ED25519_KEY_HEX [LEDGER_ENTRIES LEDGER_LAST_HASH]``
(``#`` starts a comment). The first contact with an address pins the key it presents (trust on first
use); a different key later is refused, naming the file and line to delete if the operator announced a
new key. The last ledger head verified for the server is kept on its line, so a later answer with fewer
entries or another chain is caught. The pin belongs to the address, not the contributor key, so one key
can be used with any number of federations. Design: docs/design/signing.md.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "known_servers"
ENV = "ZOO_GYM_KNOWN_SERVERS"
HEADER = "# zoo-gym known servers: ADDRESS SERVER_ED25519_KEY_HEX [LEDGER_ENTRIES LEDGER_LAST_HASH]\n"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class UntrustedServer(RuntimeError):
    """The server's key or signed state does not match what this client pinned; the message says what to do."""


@dataclass(frozen=True)
class Pin:
    address: str
    key: bytes
    line: int  # 1-based line number in the file
    head_entries: int | None = None
    head_hash: str | None = None


def default_path(near: Path) -> Path:
    """`$ZOO_GYM_KNOWN_SERVERS`, else `known_servers` in the directory `near` (the key's directory)."""
    env = os.environ.get(ENV)
    return Path(env) if env else Path(near) / FILE_NAME


def for_key(key_path: Path) -> KnownServers:
    return KnownServers(default_path(Path(key_path).expanduser().parent))


class KnownServers:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    # -- reading ------------------------------------------------------------------------------------
    def _read(self) -> list[str]:
        try:
            return self.path.read_text().splitlines()
        except FileNotFoundError:
            return []

    def _parse(self, lines: list[str]) -> dict[str, Pin]:
        pins: dict[str, Pin] = {}
        for n, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) not in (2, 4) or not _HEX64.match(fields[1]) or (
                    len(fields) == 4 and (not fields[2].isdigit() or not _HEX64.match(fields[3]))):
                raise UntrustedServer(f"{self.path} line {n} is not `ADDRESS KEY_HEX [ENTRIES LAST_HASH]`; "
                                      "fix or delete that line")
            head = (int(fields[2]), fields[3]) if len(fields) == 4 else (None, None)
            pins.setdefault(fields[0], Pin(fields[0], bytes.fromhex(fields[1]), n, *head))
        return pins

    def get(self, address: str) -> Pin | None:
        return self._parse(self._read()).get(address)

    # -- writing ------------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, lines: list[str]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _set(self, address: str, fields: str) -> int:
        """Replace (or append) `address`'s line; returns its line number."""
        lines = self._read() or [HEADER.rstrip("\n")]
        pin = self._parse(lines).get(address)
        if pin is None:
            lines.append(fields)
            n = len(lines)
        else:
            lines[pin.line - 1] = fields
            n = pin.line
        self._write(lines)
        return n

    # -- trust ----------------------------------------------------------------------------------------
    def refusal(self, pin: Pin, presented: bytes) -> UntrustedServer:
        return UntrustedServer(
            f"the server at {pin.address} presents key {presented.hex()[:16]}..., not the key "
            f"{pin.key.hex()[:16]}... pinned for it in {self.path} line {pin.line}: refusing (a man in the middle "
            f"or a new server key; delete line {pin.line} of {self.path} only if the operator announced a new key)")

    def trust(self, address: str, server_key: bytes, *, say: Callable[[str], None],
              legacy: Path | None = None) -> bytes:
        """The key pinned for `address`: `server_key` pinned now on first contact (said via `say`), or
        the earlier pin when they agree. UntrustedServer when they differ."""
        if len(server_key) != 32:
            raise UntrustedServer(f"the server at {address} sent no valid Ed25519 public key "
                                  f"({len(server_key)} bytes)")
        with self._locked():
            pin = self.get(address)
            if pin is not None:
                if pin.key != server_key:
                    raise self.refusal(pin, server_key)
                return pin.key
            line = self._set(address, f"{address} {server_key.hex()}")
        if legacy is not None and legacy.is_file() and legacy.read_text().strip() == server_key.hex():
            say(f"pinned the key of the server at {address} in {self.path} line {line} (carried over from {legacy})")
        else:
            say(f"trusting the server at {address} on first use: its key {server_key.hex()[:16]}... is now pinned "
                f"in {self.path} line {line}; compare it with the key the operator publishes")
        return server_key

    def remember_head(self, address: str, *, entries: int, last_hash: str) -> None:
        """Keep the last ledger head verified for `address` (its key must be pinned already)."""
        with self._locked():
            pin = self.get(address)
            if pin is None:
                raise UntrustedServer(f"no key pinned for {address} in {self.path}")
            fields = f"{address} {pin.key.hex()}" + (f" {entries} {last_hash}" if entries else "")
            self._set(address, fields)
