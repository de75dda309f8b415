"""Which variants are served, which are in memory: a directory of ``NAME.zgd`` files, a byte budget, LRU.

The directory is watched by listing it: a file dropped in is served from the next request on, a
removed one is gone (its memory too). ``add`` serves a file from elsewhere (or re-enables a removed
name); ``remove`` stops serving a name until it is added again. A variant is loaded on first use and
the least recently used ones are unloaded while the resident bytes (packed signs + scales + 1-D deltas)
exceed ``max_bytes``. A file built for another base is refused when it is loaded, with one line. A
directory ``NAME/`` holding a PEFT LoRA adapter is a variant too (zoo_gym.serving.peft_adapter).
"""

from __future__ import annotations

import logging
import mmap
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from zoo_gym.serving import peft_adapter
from zoo_gym.serving.variant import (
    SUFFIX,
    Variant,
    VariantError,
    NAME_RE,
    check_name,
    load_variant,
    read_manifest,
)

log = logging.getLogger("zoo_gym.serving")


class UnknownVariant(LookupError):
    """No served variant has this name."""


class VariantTooLarge(VariantError):
    """A variant alone needs more bytes than the whole budget."""


def _peek_manifest(path: pathlib.Path) -> dict:
    """The file's manifest; VariantError for anything that does not parse (never another exception)."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return read_manifest(mm)
    except VariantError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed file is skipped, whatever the parser raised
        raise VariantError(f"not a variant payload: {type(exc).__name__}: {exc}") from None
    finally:
        try:
            mm.close()
        except BufferError:  # the error's traceback still holds a view; the map is freed with it
            pass


class VariantRegistry:
    def __init__(self, directory: str | pathlib.Path | None, *, base_sha256: str, max_bytes: int | None = None,
                 check: Callable[[Variant], None] = lambda v: None,
                 prepare: Callable[[Variant], Variant] = lambda v: v) -> None:
        self.directory = pathlib.Path(directory) if directory else None
        self.base_sha256 = base_sha256
        self.max_bytes = max_bytes
        self._check, self._prepare = check, prepare
        self._lock = threading.RLock()
        self._loaded: OrderedDict[str, Variant] = OrderedDict()  # least recently used first
        self._extra: dict[str, pathlib.Path] = {}  # added by path
        self._removed: set[str] = set()
        self._foreign: dict[tuple, str] = {}  # (path, mtime, size) -> why it is not served

    # ------------------------------------------------------------ what is served
    def _files(self) -> dict[str, pathlib.Path]:
        out: dict[str, pathlib.Path] = {}
        if self.directory is not None and self.directory.is_dir():
            for p in sorted(self.directory.glob(f"*{SUFFIX}")):
                name = p.name.removesuffix(SUFFIX)
                try:
                    out[check_name(name)] = p
                except VariantError:
                    continue
            for p in sorted(self.directory.iterdir()):
                if peft_adapter.is_peft_dir(p) and NAME_RE.match(p.name) and p.name not in out:
                    out[p.name] = p
        out.update(self._extra)
        return {n: p for n, p in out.items() if n not in self._removed}

    def _refusal(self, path: pathlib.Path) -> str | None:
        """Why the file cannot be served (cached by mtime and size), or None."""
        try:
            st = path.stat()
        except OSError:
            return "the file is gone"
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in self._foreign:
            try:
                sha = (peft_adapter.peft_base_sha256(path) if path.is_dir() else _peek_manifest(path)["base_sha256"])
                why = None if sha in (None, self.base_sha256) else (
                    f"built for base {sha[:12]}, this server's base is {self.base_sha256[:12]}")
            except Exception as exc:  # noqa: BLE001 - any file that does not parse is skipped with one line
                why = str(exc) or type(exc).__name__
            if why:
                log.warning("not serving %s: %s", path.name, why)
            self._foreign[key] = why or ""
        return self._foreign[key] or None

    def names(self) -> list[str]:
        """The served variants (files of this base), loaded or not."""
        with self._lock:
            files = self._files()
            for name in list(self._loaded):
                if name not in files:
                    del self._loaded[name]  # its file was removed
            return [n for n, p in files.items() if self._refusal(p) is None]

    # ------------------------------------------------------------ loading
    def get(self, name: str) -> Variant:
        """The loaded variant, loading (and evicting others) if needed; UnknownVariant, VariantError."""
        with self._lock:
            if name in self._loaded and name not in self._removed:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            path = self._files().get(name)
            if path is None:
                raise UnknownVariant(name)
            return self._load(name, path)

    def _load(self, name: str, path: pathlib.Path) -> Variant:
        try:
            v = (peft_adapter.peft_variant(path, base_sha256=self.base_sha256, name=name) if path.is_dir()
                 else load_variant(path, base_sha256=self.base_sha256, name=name))
            self._check(v)
        except VariantError:
            raise
        except Exception as exc:  # noqa: BLE001 - a file that does not parse is refused, not a crash
            raise VariantError(f"variant {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
        if self.max_bytes is not None and v.nbytes > self.max_bytes:
            raise VariantTooLarge(f"variant {name!r} needs {v.nbytes} bytes, more than --max-variant-bytes "
                                  f"{self.max_bytes}")
        self._loaded.pop(name, None)
        while self.max_bytes is not None and self._loaded and self.resident_bytes() + v.nbytes > self.max_bytes:
            evicted, _ = self._loaded.popitem(last=False)
            log.info("unloaded variant %s (least recently used; budget %d bytes)", evicted, self.max_bytes)
        self._loaded[name] = self._prepare(v)
        log.info("loaded variant %s (%d bytes)", name, v.nbytes)
        return self._loaded[name]

    def add(self, *, name: str | None = None, path: str | pathlib.Path | None = None) -> Variant:
        """Serve (and load now) a variant: a name in the directory, or a file elsewhere under ``name``."""
        with self._lock:
            if path is not None:
                p = pathlib.Path(path)
                if peft_adapter.is_peft_dir(p):
                    name = check_name(name or p.name)
                elif p.suffix != SUFFIX:
                    raise VariantError(f"{p}: a variant is a file NAME{SUFFIX} or a PEFT adapter directory")
                elif not p.is_file():
                    raise UnknownVariant(f"no such file: {p}")
                name = check_name(name or p.name.removesuffix(SUFFIX))
            else:
                name = check_name(name or "")
                self._removed.discard(name)
                p = self._files().get(name)
                if p is None:
                    raise UnknownVariant(name)
            v = self._load(name, p)  # raises before anything changes
            if path is not None:
                self._extra[name] = p
            self._removed.discard(name)
            return v

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._files():
                raise UnknownVariant(name)
            self._loaded.pop(name, None)
            self._extra.pop(name, None)
            self._removed.add(name)

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._loaded.values())

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)
