"""The contributor's kept variants and the base each was trained over, for the Try it view's right pane.

`join --keep-variant` writes WORKDIR/variants/ID-roundN.zgd: a BitDelta over round N's base checkpoint,
whose manifest names that checkpoint's sha256 (``checkpoint_sha256``) and its weights' (``base_sha256``).
join unpacked that checkpoint in WORKDIR/checkpoints/<sha256>/ (client/download.py), and gym-serve serves a
variant only over the base it names, never over the newer checkpoint a pull fetches: so the console runs a
second gym-serve over that directory. Variants made otherwise (`gym-client personalize`) name no checkpoint
and are left to the first gym-serve.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

from zoo_gym.proto import archive

NO_VARIANT = ("no variant of yours yet: tick --keep-variant on Join and the join keeps each round's delta as "
              "one (written after its last round)")
_ROUND = re.compile(r"-(round|version)(\d+)$")


class NoBase(RuntimeError):
    """The variant's base checkpoint is not in the download cache any more; the message says which."""


@dataclass(frozen=True)
class Kept:
    name: str  # its model id in gym-serve
    path: Path
    round: int | None  # the round (or async version) it was trained in
    checkpoint_sha256: str  # the checkpoint it is a delta over
    base_sha256: str  # that checkpoint's weights sha256, what gym-serve checks

    @property
    def label(self) -> str:
        trained = f"round {self.round}" if self.round is not None else self.name
        return f"your variant of {trained} over base {self.checkpoint_sha256[:12]}"

    def base_dir(self, home: Path) -> Path:
        """The unpacked checkpoint it was trained over; NoBase when the cache no longer has it."""
        model_dir = home / "checkpoints" / self.checkpoint_sha256
        if not (model_dir / archive.WEIGHTS).is_file():
            raise NoBase(f"variant {self.name}: its base, checkpoint {self.checkpoint_sha256[:12]}, is not in "
                         f"{home / 'checkpoints'} any more; join a round with --keep-variant to make a new one")
        return model_dir


def _manifest(path: Path) -> dict | None:
    from zoo_gym.serving.variant import VariantError, read_manifest

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return dict(read_manifest(mm))
    except (OSError, ValueError, BufferError, VariantError):  # BufferError: a view still held at close
        return None


def kept(home: Path) -> list[Kept]:
    """The round variants in HOME/variants, oldest first (by modification time, then name)."""
    found = []
    for path in sorted((home / "variants").glob("*.zgd"), key=lambda p: (p.stat().st_mtime, p.name)):
        meta = _manifest(path)
        sha = (meta or {}).get("checkpoint_sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            continue
        name = path.name.removesuffix(".zgd")
        m = _ROUND.search(name)
        found.append(Kept(name=name, path=path, round=int(m[2]) if m else None, checkpoint_sha256=sha,
                          base_sha256=meta["base_sha256"]))
    return found


def newest(home: Path) -> Kept | None:
    """The variant the right pane talks to: the one kept last, or None."""
    found = kept(home)
    return found[-1] if found else None
