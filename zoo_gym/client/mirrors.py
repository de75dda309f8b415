"""Checkpoint bytes from the HTTP mirrors a server's signed RoundInfo names (docs/design/SCALE-OUT.md).

A mirror serves a published checkpoint at `<URL>/<sha256>`. Each is tried in order before the server's
DownloadCheckpoint, appending to the partial file that download resumes (`Range: bytes=N-`), under a
connect/read timeout and a throughput floor (`MirrorPolicy`). A connection dropped half-way is resumed
with another range request while it makes progress. The whole file must hash to the signed sha256: a
mirror that is down, slow, or serves other bytes is named in one line, bytes that fail verification are
discarded, and the next mirror, then the server, is tried. Mirror bytes never verified are cut off before
the server's download resumes the file. Standard library only (urllib).
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from zoo_gym import __version__

TIMEOUT_ENV, MIN_RATE_ENV = "ZOO_GYM_MIRROR_TIMEOUT", "ZOO_GYM_MIRROR_MIN_BYTES_PER_S"
_READ = 1 << 20


@dataclass(frozen=True)
class MirrorPolicy:
    """How long a mirror is given: `timeout` seconds to connect and between two reads; abandoned when a
    `window_s` window brings less than `min_bytes_per_s`; `max_resumes` range requests after drops."""

    timeout: float = 15.0
    min_bytes_per_s: float = 256 * 1024
    window_s: float = 10.0
    max_resumes: int = 3

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> MirrorPolicy:
        """The defaults, with ZOO_GYM_MIRROR_TIMEOUT and ZOO_GYM_MIRROR_MIN_BYTES_PER_S when set."""
        values = {}
        for env, name in ((TIMEOUT_ENV, "timeout"), (MIN_RATE_ENV, "min_bytes_per_s")):
            text = environ.get(env, "").strip()
            if text:
                try:
                    values[name] = float(text)
                except ValueError:
                    raise ValueError(f"{env}={text!r}: must be a number") from None
                if not values[name] > 0:
                    raise ValueError(f"{env}={text!r}: must be > 0")
        return cls(**values)


class MirrorFailed(Exception):
    """This mirror cannot serve the checkpoint now; the message says why, in a few words."""


class _Dropped(Exception):
    """The response ended before the checkpoint's end; `got` bytes came first."""

    def __init__(self, got: int) -> None:
        super().__init__(f"the connection ended early ({got} bytes in)")
        self.got = got


def from_mirrors(mirrors: Sequence[str], sha256: str, size: int, partial: Path, *,
                 policy: MirrorPolicy | None = None, say: Callable[[str], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> str | None:
    """Fill `partial` with checkpoint `sha256` (`size` bytes) from the first of `mirrors` that serves it
    whole and verified, and return that mirror's URL; None when none did. `partial` then holds what it held
    before (none of it when that failed verification with a mirror's bytes), ready for the server."""
    policy = policy or MirrorPolicy.from_env()
    tell = say or (lambda line: None)
    kept = _size(partial)  # what an earlier run left: trusted as much as before, no more
    if not mirrors or kept >= size:
        return None  # the server's path handles a finished (or oversized) partial file
    for i, base in enumerate(mirrors):
        then = "the next mirror" if i + 1 < len(mirrors) else "the server"
        if not base.startswith(("http://", "https://")):
            tell(f"mirror {base}: not an http(s) URL; trying {then}")
            continue
        try:
            _fill(f"{base.rstrip('/')}/{sha256}", partial, size, policy, progress)
        except MirrorFailed as exc:
            tell(f"mirror {base}: {exc}; trying {then}")
            continue
        if _sha256(partial) == sha256:
            return base
        partial.unlink()
        kept = 0
        tell(f"mirror {base}: served other bytes (not the signed sha256 {sha256[:12]}); discarded them, "
             f"trying {then}")
    if _size(partial) > kept:
        with open(partial, "r+b") as f:
            f.truncate(kept)
    return None


def _fill(url: str, partial: Path, size: int, policy: MirrorPolicy, progress) -> None:
    """Append `url`'s bytes to `partial` until it holds `size`; resume after a drop that made progress."""
    resumes = 0
    while (have := _size(partial)) < size:
        try:
            _get(url, partial, have, size, policy, progress)
        except _Dropped as exc:
            if exc.got == 0 or resumes >= policy.max_resumes:
                raise MirrorFailed(f"{exc}, after {resumes} resumed request(s)") from None
            resumes += 1


def _get(url: str, partial: Path, have: int, size: int, policy: MirrorPolicy, progress) -> None:
    """One GET from byte `have` (a range request unless 0), appended to `partial`; _Dropped when it ends early."""
    headers = {"User-Agent": f"zoo-gym/{__version__}"} | ({"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=policy.timeout)
    except urllib.error.HTTPError as exc:
        raise MirrorFailed(f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MirrorFailed(f"unreachable ({getattr(exc, 'reason', None) or exc})") from None
    with resp:
        skip = have if resp.status == 200 else 0  # a mirror that ignores Range sends it all: skip what we have
        if resp.status == 206 and not str(resp.headers.get("Content-Range", "")).startswith(f"bytes {have}-"):
            raise MirrorFailed(f"answered the range from {have} with {resp.headers.get('Content-Range')!r}")
        if resp.status not in (200, 206):
            raise MirrorFailed(f"HTTP {resp.status}")
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) + (have - skip) != size:
            raise MirrorFailed(f"serves {int(length) + have - skip} bytes; the signed size is {size}")
        _copy(resp, partial, skip=skip, size=size, policy=policy, progress=progress)


def _copy(resp, partial: Path, *, skip: int, size: int, policy: MirrorPolicy, progress) -> None:
    got, window_start, window_bytes = 0, time.monotonic(), 0
    with open(partial, "ab") as f:
        while f.tell() < size:
            try:
                chunk = resp.read1(min(_READ, skip or size - f.tell()))
            except TimeoutError:
                raise MirrorFailed(f"sent nothing for {policy.timeout:g} s") from None
            except OSError as exc:
                raise _Dropped(got) from exc
            if not chunk:
                raise _Dropped(got)
            got += len(chunk)
            if skip:
                skip -= len(chunk)
                continue
            f.write(chunk)
            if progress is not None:
                progress(len(chunk))
            window_bytes += len(chunk)
            if (elapsed := time.monotonic() - window_start) >= policy.window_s:
                if window_bytes / elapsed < policy.min_bytes_per_s:
                    raise MirrorFailed(f"too slow ({window_bytes / elapsed:.0f} bytes/s over {elapsed:.1f} s, "
                                       f"below the floor of {policy.min_bytes_per_s:.0f}; {MIN_RATE_ENV})")
                window_start, window_bytes = time.monotonic(), 0


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
