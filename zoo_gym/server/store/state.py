"""The server's state directory: database, blob store, signing key, genesis checkpoint.

    state.json         base model, database URL (--db), validation file, chat template source (by init)
    validation.json[l] the server's held-out examples (a copy of --validation-data), when given
    server.db          SQLite (default; any SQLAlchemy URL through --db)
    server.lock        held (flock) by the one `gym-server serve` of the directory; holds its PID
    serve.json         the settings that serve runs with, which `gym-server ingest` processes take
    server_key.pem     the server's Ed25519 key (signs the ledger)
    blobs/ and work/   content-addressed checkpoints and submissions (blobs.py); aggregation scratch
Nothing in state.json names the directory itself, so it can be copied or moved. `gym-server init`
creates it (zoo_gym/server/genesis.py); this module opens, locks and migrates it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlmodel import Session, select

from zoo_gym.proto import signing
from zoo_gym.proto import archive
from zoo_gym.server.store import migrations
from zoo_gym.server.store.blobs import BlobStore
from zoo_gym.server.store.engine import make_engine
from zoo_gym.server.store.models import Round, Submission

if TYPE_CHECKING:
    from zoo_gym.io.safetensors_reader import WeightsFile

STATE_FILE = "state.json"
DB_FILE = "server.db"
LOCK_FILE = "server.lock"
SERVE_FILE = "serve.json"
# The PostgreSQL advisory lock that serialises writes across processes (serve and its ingest processes): one
# constant key; advisory locks are per database, so two federations on one PostgreSQL server never share it.
WRITE_LOCK_KEY = 0x7A6F6F2D67796D  # "zoo-gym"


class StateError(RuntimeError):
    """The state directory is missing, incomplete, or already initialised."""


def register_tables() -> None:
    """Import every module that defines tables so create_all sees them (server's and rewards')."""
    import zoo_gym.server.store.models  # noqa: F401

    try:
        from zoo_gym.rewards.ledger import LedgerEntry  # the ledger and reputation tables
        from zoo_gym.rewards.reputation import Reputation

        del LedgerEntry, Reputation
    except ImportError:  # rewards not installed in a trimmed build: the server still serves rounds
        pass


class StateLock:
    """The exclusive lock of the one process serving a state directory: ``flock`` on
    ``<state-dir>/server.lock``, which holds that process's PID. The kernel releases it when the process
    ends, however it ends (kill -9 included); the file itself stays."""

    def __init__(self, root: Path) -> None:
        self._fd: int | None = None
        self.path = Path(root) / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateError(f"{root} is already served by gym-server PID {holder} (it holds {self.path}); stop "
                             "that server first, or serve another --state-dir") from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    __del__ = release  # a state dropped without release (a command that failed in-process) unlocks too


PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # the directory holds the key, the rows and the uploads: owner only


def make_private(path: Path) -> None:
    """chmod a tree to 0700 directories and 0600 files (symlinks left alone), as the server's key already is.

    `serve` runs it over its whole state directory, so directories made by older versions (0755, a
    world-readable server.db) are tightened on upgrade. Where chmod is refused (a file of another user, a
    file system without modes) it warns once and goes on: refusing to serve would protect nothing."""
    failed: list[OSError] = []
    for dirpath, _dirs, files in os.walk(path):
        for name, mode in [(dirpath, PRIVATE_DIR)] + [(os.path.join(dirpath, f), PRIVATE_FILE) for f in files]:
            if not os.path.islink(name):
                try:
                    os.chmod(name, mode)
                except OSError as exc:
                    failed.append(exc)
    if failed:
        logging.getLogger("zoo_gym.server").warning(
            "could not make %d paths under %s owner-only, e.g. %s: %s", len(failed), path, failed[0].filename,
            failed[0].strerror)


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, PRIVATE_FILE)  # an existing file keeps its mode through O_CREAT
        f.write(text)


def create_private_sqlite(url: str) -> None:
    """Create a SQLite database file 0600 before SQLite does (it would make it 0644); SQLite gives its
    -wal and -shm files the database file's mode."""
    path = sqlite_file(url)
    if path is not None and not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))


def default_db_url(root: Path) -> str:
    return f"sqlite:///{(root / DB_FILE).resolve()}"


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (None for other databases and in-memory SQLite)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StateError(f"database URL {url!r} is not a SQLAlchemy URL ({exc})") from None
    if not parsed.get_backend_name() == "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _stored_db_url(root: Path, stored: str | None) -> str:
    """The database of a state directory from what its state.json says.

    None (or "default") is init's default, the server.db beside state.json. Some state directories store
    that default as an absolute ``sqlite:///<dir>/server.db``; once such a directory is copied or moved it
    must use its own server.db, not the one where it was made. init only ever creates
    a server.db inside the directory for that default (a database chosen with --db lives at its URL), so
    an absolute SQLite URL ending in server.db means this directory's own database whenever one is here."""
    if stored in (None, "default"):
        return default_db_url(root)
    path = sqlite_file(stored)
    if path is not None and path.name == DB_FILE and (root / DB_FILE).is_file():
        return default_db_url(root)
    return stored


def engine_for(url: str) -> Engine:
    """make_engine, with a URL SQLAlchemy cannot use (unknown dialect, driver not installed) as a StateError."""
    try:
        return make_engine(url)
    except ImportError as exc:
        if url.startswith("postgresql"):
            raise StateError("PostgreSQL needs the psycopg driver: pip install 'zoo-gym[postgres]' "
                             f"({exc})") from None
        raise StateError(f"cannot use the database URL {url!r}: {exc}") from None
    except ArgumentError as exc:
        raise StateError(f"cannot use the database URL {url!r}: {exc}") from None


def shown_url(url: str) -> str:
    """A database URL fit for a message (no password)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


_UNPACK_LOCK = threading.Lock()
_WRITING = threading.local()  # how many write sessions this thread is inside


def _take_write_lock(_session, _transaction, connection) -> None:
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": WRITE_LOCK_KEY})


@dataclass
class ServerState:
    root: Path
    engine: Engine
    blobs: BlobStore
    key: Ed25519PrivateKey
    base_model: str
    # One writer at a time: SQLite serialises writers anyway; this keeps our read-check-write steps atomic.
    write_lock: threading.RLock
    # Held while this process serves the directory (open_state(..., exclusive=True)); None for readers.
    lock: StateLock | None = None
    # The held-out examples chosen at init (--validation-data), copied into the directory; None: built in.
    validation_file: Path | None = None

    @property
    def public_key(self) -> bytes:
        return signing.public_bytes(self.key)

    @property
    def work_dir(self) -> Path:
        path = self.root / "work"
        path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        return path

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    @contextmanager
    def write_session(self) -> Iterator[Session]:
        """A session for a read-check-write step (a submission, a round's close, a publish's commit, a sweep).

        Holds this process's write lock; on PostgreSQL each of the session's transactions also takes the
        transaction-level advisory lock WRITE_LOCK_KEY as its first statement, held to its commit or rollback,
        so the same steps of `gym-server serve` and of its `gym-server ingest` processes never interleave.
        A write session must not open another inside it (the inner one would wait for the outer's lock)."""
        postgres = self.engine.dialect.name == "postgresql"
        with self.write_lock:
            if postgres and getattr(_WRITING, "depth", 0):
                raise RuntimeError("a write session inside another would wait for its own advisory lock")
            _WRITING.depth = getattr(_WRITING, "depth", 0) + 1
            try:
                with self.session() as s:
                    if postgres:
                        event.listen(s, "after_begin", _take_write_lock)
                    yield s
            finally:
                _WRITING.depth -= 1

    def current_round(self, session: Session) -> Round | None:
        return session.exec(select(Round).order_by(Round.id.desc()).limit(1)).first()

    def checkpoint_dir(self, sha256: str) -> Path:
        """The unpacked Hugging Face directory of a stored checkpoint, weights included (cached under work/).

        One unpack at a time, the rest wait for it: concurrent submissions for a base not unpacked yet
        would otherwise unpack it side by side into one temporary directory and break each other."""
        return self._unpacked(sha256, weights=True)

    def checkpoint_files(self, sha256: str) -> tuple[Path, WeightsFile]:
        """A stored checkpoint's directory without its weights (config, tokenizer, lineage: cached under
        work/) and its weights in place in the archive blob: what the evaluator reads, no model-sized copy."""
        from zoo_gym.io.safetensors_reader import WeightsFile  # torch: status and ledger stay light (test_light_commands)

        return self._unpacked(sha256, weights=False), WeightsFile.in_archive(self.blobs.path(sha256))

    def _unpacked(self, sha256: str, *, weights: bool) -> Path:
        dest = self.work_dir / "checkpoints" / sha256
        done = (dest / archive.WEIGHTS).is_file if weights else dest.is_dir  # unpack replaces dest atomically
        if not done():
            with _UNPACK_LOCK:
                if not done() and weights and dest.is_dir():  # unpacked without its weights (the evaluator's)
                    archive.unpack_member(self.blobs.path(sha256), dest, archive.WEIGHTS)  # others keep reading
                elif not done():
                    skip = frozenset() if weights else frozenset({archive.WEIGHTS})
                    archive.unpack(self.blobs.path(sha256), dest, skip=skip)
                    os.chmod(dest.parent, PRIVATE_DIR)
                    make_private(dest)
        return dest


def open_state(state_dir: Path, *, db_url: str | None = None, exclusive: bool = False) -> ServerState:
    """Open an initialised state directory.

    ``exclusive=True`` is for the one process that serves it: it takes the directory's lock (StateError
    naming the holder's PID when another process serves it) before touching anything, and removes the
    leftovers of uploads a crash interrupted. Without it (status, ledger) nothing is locked or removed, so
    those commands work beside a running server."""
    root = Path(state_dir)
    meta_path = root / STATE_FILE
    if not meta_path.is_file():
        raise StateError(f"{root} is not a gym-server state directory; create it with `gym-server init`")
    try:
        meta = json.loads(meta_path.read_text())
        stored = meta.get("db_url")
    except (ValueError, AttributeError) as exc:
        raise StateError(f"{meta_path} is damaged ({exc}); it is not JSON written by `gym-server init`") from None
    if not (root / "server_key.pem").is_file():
        raise StateError(f"{root}/server_key.pem is missing; the ledger's signatures cannot be continued")
    lock = StateLock(root) if exclusive else None
    try:
        if exclusive:
            make_private(root)  # before SQLite opens (and makes -wal/-shm like) the database
        url = db_url or _stored_db_url(root, stored)
        db_file = sqlite_file(url)
        if db_file is not None and not db_file.is_file():  # SQLite would create an empty one
            raise StateError(f"the database {db_file} of {root} is missing; restore it from a backup")
        engine = engine_for(url)
        register_tables()
        try:
            migrations.check_at_head(engine, str(root))  # an older schema: `gym-server migrate` upgrades it
        except migrations.SchemaError as exc:
            engine.dispose()
            raise StateError(str(exc)) from None
        key, _ = signing.load_or_create_key(root / "server_key.pem")
        blobs = BlobStore(root / "blobs")
        if exclusive:
            blobs.clean_tmp()  # only the serving process may: a reader would delete a live server's uploads
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    validation = meta.get("validation_file")
    return ServerState(root, engine, blobs, key, meta.get("base_model", "?"), threading.RLock(), lock,
                       validation_file=(root / Path(validation).name) if validation else None)


@dataclass
class MigrationReport:
    current: str  # the database's revision before
    head: str  # this code's newest revision
    pending: list[migrations.Step]
    applied: bool
    backup: Path | None = None  # the copy of the SQLite file made first


def migrate_state(state_dir: Path, *, db_url: str | None = None, dry_run: bool = False) -> MigrationReport:
    """Bring the database of a state directory to this code's schema (`gym-server migrate`).

    Holds the directory's lock (a serving gym-server is refused by name), copies a SQLite file to
    ``server.db.<old revision>.bak`` and applies every pending revision in one transaction. PostgreSQL's
    DDL is transactional too; back it up with pg_dump first (nothing here copies a server database)."""
    root = Path(state_dir)
    meta_path = root / STATE_FILE
    if not meta_path.is_file():
        raise StateError(f"{root} is not a gym-server state directory; create it with `gym-server init`")
    try:
        stored = json.loads(meta_path.read_text()).get("db_url")
    except (ValueError, AttributeError) as exc:
        raise StateError(f"{meta_path} is damaged ({exc}); it is not JSON written by `gym-server init`") from None
    lock = StateLock(root)
    try:
        url = db_url or _stored_db_url(root, stored)
        db_file = sqlite_file(url)
        if db_file is not None and not db_file.is_file():
            raise StateError(f"the database {db_file} of {root} is missing; restore it from a backup")
        engine = engine_for(url)
        try:
            with engine.connect() as conn:
                current = migrations.current_revision(conn)
                steps = migrations.pending(conn)
        except migrations.SchemaError as exc:
            raise StateError(str(exc)) from None
        finally:
            engine.dispose()
        report = MigrationReport(current or "none", migrations.head(), steps, applied=False)
        if dry_run or not steps:
            return report
        if db_file is not None:
            report.backup = migrations.backup_sqlite(db_file, report.current)
        migrations.upgrade(url)
        report.applied = True
        return report
    finally:
        lock.release()


def record_serve_settings(root: Path, settings: dict) -> None:
    """Write serve.json, the settings `serve` runs with (every key), for its ingest processes: whole (a
    temporary file renamed into place) and owner only."""
    path = Path(root) / SERVE_FILE
    tmp = path.with_name(f".{SERVE_FILE}.{os.getpid()}")
    write_private(tmp, json.dumps({"settings": settings}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def serve_settings(root: Path) -> tuple[dict, tuple] | None:
    """(serve.json's settings, a stamp that changes whenever serve writes it again), or None when no `serve`
    has run on this directory yet."""
    path = Path(root) / SERVE_FILE
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StateError(f"{path} cannot be read ({exc}); restart `gym-server serve`, which writes it") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("settings"), dict):
        raise StateError(f"{path} holds no settings; restart `gym-server serve`, which writes it")
    return doc["settings"], (st.st_ino, st.st_mtime_ns, st.st_size)


def serve_settings_stamp(root: Path) -> tuple | None:
    """serve_settings' stamp without reading the file (None: no serve.json)."""
    try:
        st = os.stat(Path(root) / SERVE_FILE)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def open_ingest_state(state_dir: Path, *, db_url: str | None = None) -> ServerState:
    """open_state for a `gym-server ingest` process: on PostgreSQL only (StateError naming --db otherwise),
    without the directory's lock (serve holds it). It stages uploads in a directory of its own: `blobs.own_tmp()`."""
    state = open_state(state_dir, db_url=db_url)
    if state.engine.dialect.name != "postgresql":
        state.engine.dispose()
        raise StateError(f"gym-server ingest needs PostgreSQL ({state_dir} uses {state.engine.dialect.name}): "
                         "several processes write one database; give --db postgresql://USER@HOST/DB, the database "
                         "`gym-server serve` of this directory uses")
    return state


def count_submissions(state: ServerState, round_id: int) -> int:
    """Submissions stored in round `round_id`."""
    from sqlmodel import func

    with state.session() as s:
        return int(s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == round_id)).one())


def use_init_validation(config, state) -> None:
    """Score on the validation file chosen at `init` unless the config names another (`serve` and every server
    built in-process alike; without it a server would score on the built-in task's examples)."""
    if config.validation_data is None and state.validation_file is not None:
        config.validation_data = str(state.validation_file)
