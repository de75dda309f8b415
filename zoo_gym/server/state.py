"""The server's state directory: database, blob store, signing key, genesis checkpoint.

    <state-dir>/
      state.json        database URL and base model, written once by `gym-server init`
      server.db         SQLite (default; any SQLAlchemy URL through --db)
      server_key.pem    the server's Ed25519 key (signs the ledger)
      blobs/            content-addressed checkpoints and submissions (see blobs.py)
      work/             scratch space for aggregation
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, create_engine, select

from zoo_gym.proto import signing
from zoo_gym.proto import archive
from zoo_gym.server.blobs import BlobStore
from zoo_gym.server.models import Checkpoint, Round, RoundState

STATE_FILE = "state.json"


class StateError(RuntimeError):
    """The state directory is missing, incomplete, or already initialised."""


def _register_tables() -> None:
    """Import every module that defines tables so create_all sees them (server's and rewards')."""
    import zoo_gym.server.models  # noqa: F401

    try:
        import zoo_gym.rewards  # noqa: F401  (ledger and reputation tables)
    except ImportError:  # rewards not installed in a trimmed build: the server still serves rounds
        pass


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # durable and concurrent enough for one server
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


_UNPACK_LOCK = threading.Lock()


@dataclass
class ServerState:
    root: Path
    engine: Engine
    blobs: BlobStore
    key: Ed25519PrivateKey
    base_model: str
    # One writer at a time: SQLite serialises writers anyway; this keeps our read-check-write steps atomic.
    write_lock: threading.RLock

    @property
    def public_key(self) -> bytes:
        return signing.public_bytes(self.key)

    @property
    def work_dir(self) -> Path:
        path = self.root / "work"
        path.mkdir(exist_ok=True)
        return path

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    def current_round(self, session: Session) -> Round | None:
        return session.exec(select(Round).order_by(Round.id.desc()).limit(1)).first()

    def checkpoint_dir(self, sha256: str) -> Path:
        """The unpacked Hugging Face directory of a stored checkpoint (cached under work/).

        Concurrent submissions for a base not unpacked yet used to unpack it side by side into
        one temporary directory and break each other; one unpack at a time, the rest wait for it."""
        dest = self.work_dir / "checkpoints" / sha256
        if not (dest / archive.WEIGHTS).is_file():
            with _UNPACK_LOCK:
                if not (dest / archive.WEIGHTS).is_file():
                    archive.unpack(self.blobs.path(sha256), dest)
        return dest


def _resolve_base_model(base_model: str) -> Path:
    if base_model == "tiny":
        from zoo_gym.gym_train import tiny_model_dir

        return tiny_model_dir()
    path = Path(base_model).expanduser()
    if path.is_dir():
        return path
    # A hub id already in the user's Hugging Face cache; never downloads.
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(base_model, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any failure means "not available locally"
        raise StateError(
            f"--base-model {base_model!r} is neither 'tiny', a local directory, nor a model in the local "
            "Hugging Face cache (nothing is downloaded at run time)"
        ) from exc


def _normalised_copy(src: Path, dest: Path) -> None:
    """Copy a model directory as a single-file safetensors Hugging Face directory."""
    if (src / archive.WEIGHTS).is_file():
        for p in sorted(src.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                shutil.copyfile(p, dest / p.name)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(dest, max_shard_size="1000GB")
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)


def init_state(state_dir: Path, *, base_model: str = "tiny", db_url: str | None = None) -> ServerState:
    """Create a new state directory with the genesis checkpoint (round 0) and round 1 open."""
    root = Path(state_dir)
    if (root / STATE_FILE).exists():
        raise StateError(f"{root} is already initialised; `gym-server serve --state-dir {root}` resumes it")
    root.mkdir(parents=True, exist_ok=True)
    src = _resolve_base_model(base_model)
    url = db_url or f"sqlite:///{(root / 'server.db').resolve()}"
    key, _ = signing.load_or_create_key(root / "server_key.pem")
    engine = make_engine(url)
    _register_tables()
    SQLModel.metadata.create_all(engine)
    state = ServerState(root, engine, BlobStore(root / "blobs"), key, base_model, threading.RLock())

    with tempfile.TemporaryDirectory(dir=state.work_dir) as tmp:
        genesis = Path(tmp) / "genesis"
        genesis.mkdir()
        _normalised_copy(src, genesis)
        archive.write_lineage(genesis, {"round": 0, "parent_sha256": None, "base_model": base_model})
        with state.blobs.writer() as w:
            archive.pack(genesis, w)
            sha = w.commit()
        size = state.blobs.size(sha)
    with state.session() as s:
        s.add(Checkpoint(sha256=sha, round_id=0, parent_sha256=None, size=size,
                         manifest_json=json.dumps({"round": 0, "base_model": base_model})))
        s.add(Round(id=1, state=RoundState.OPEN, base_sha256=sha))
        s.commit()
    (root / STATE_FILE).write_text(json.dumps({"db_url": url, "base_model": base_model}, indent=2) + "\n")
    return state


def open_state(state_dir: Path, *, db_url: str | None = None) -> ServerState:
    root = Path(state_dir)
    meta_path = root / STATE_FILE
    if not meta_path.exists():
        raise StateError(f"{root} is not a gym-server state directory; create it with `gym-server init`")
    meta = json.loads(meta_path.read_text())
    engine = make_engine(db_url or meta["db_url"])
    _register_tables()
    SQLModel.metadata.create_all(engine)  # adds tables of newer versions; never alters existing ones
    if not (root / "server_key.pem").is_file():
        raise StateError(f"{root}/server_key.pem is missing; the ledger's signatures cannot be continued")
    key, _ = signing.load_or_create_key(root / "server_key.pem")
    blobs = BlobStore(root / "blobs")
    blobs.clean_tmp()
    return ServerState(root, engine, blobs, key, meta.get("base_model", "?"), threading.RLock())
