"""Schema migrations of the server's database (Alembic), shipped inside the package.

One revision per schema change in ``versions/``: ``0000`` (ROOT) and ``0001`` (BASELINE, 0000 plus
``roundinputs``) are the schemas written without a version table. ``gym-server init`` creates the current
tables and stamps the head; every other command refuses a database below the head in one line naming
``gym-server migrate``, which backs up a SQLite file and applies what is pending in one transaction.
An unversioned database holding ``round`` is read as ``0001`` with ``roundinputs``, else ``0000``.
A model change needs a new revision: ``python -m zoo_gym.server.store.migrations new "what changed"``.
Details: docs/design/schema-migrations.md.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Connection, Engine

MIGRATIONS_DIR = Path(__file__).resolve().parent
ROOT = "0000"  # the schema f956b6f's `gym-server init` wrote (no version table)
BASELINE = "0001"  # the schema v0.1.0's `gym-server init` wrote (no version table): ROOT plus roundinputs


class SchemaError(RuntimeError):
    """The database's schema is not the one this code needs (older, newer, or unknown)."""


@dataclass(frozen=True)
class Step:
    revision: str
    message: str


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    return cfg


@functools.cache
def script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    return script().get_current_head()


def target_metadata():
    from sqlmodel import SQLModel

    import zoo_gym.server.store.models  # noqa: F401

    try:
        from zoo_gym.rewards.ledger import LedgerEntry  # the ledger and reputation tables
        from zoo_gym.rewards.reputation import Reputation

        del LedgerEntry, Reputation
    except ImportError:
        pass
    return SQLModel.metadata


def _quiet() -> None:
    """Alembic says "Context impl SQLiteImpl." at INFO on every check; the server's log is not the place."""
    logger = logging.getLogger("alembic.runtime.migration")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def current_revision(conn: Connection) -> str | None:
    """The database's revision: its stamp; for an unstamped database BASELINE (v0.1.0's) when it holds
    ``roundinputs``, ROOT (f956b6f's) when it does not; None when it holds no gym-server tables."""
    _quiet()
    rev = MigrationContext.configure(conn).get_current_revision()
    if rev is None and inspect(conn).has_table("round"):
        return BASELINE if inspect(conn).has_table("roundinputs") else ROOT
    return rev


def pending(conn: Connection, *, empty_ok: bool = False, to: str = "head") -> list[Step]:
    """The revisions above the database's up to `to`, oldest first (SchemaError for a revision this code does
    not know). An empty database is refused unless `empty_ok` (then every revision is pending)."""
    current = current_revision(conn)
    if current is None and not empty_ok:
        raise SchemaError("the database holds no gym-server tables; create a federation with `gym-server init`")
    try:
        revs = list(script().iterate_revisions(head() if to == "head" else to, current or "base"))
    except RevisionError:  # a revision written by a newer zoo-gym
        raise SchemaError(f"the database is at schema revision {current}, which this zoo-gym does not know: it was "
                          "written by a newer version; upgrade zoo-gym") from None
    return [Step(r.revision, (r.doc or "").strip().splitlines()[0] if r.doc else "") for r in reversed(revs)
            if r.revision != current]


def check_at_head(engine: Engine, where: str) -> None:
    """SchemaError (one line naming `gym-server migrate`) unless the database is at the head."""
    with engine.connect() as conn:
        steps = pending(conn)
        current = current_revision(conn)
    if steps:
        raise SchemaError(f"the database of {where} is at schema revision {current} and this gym-server needs "
                          f"{head()} ({len(steps)} migration(s) pending); run `gym-server migrate --state-dir "
                          f"{where}` (it backs up a SQLite file first)")


def stamp_head(conn: Connection) -> None:
    _quiet()
    MigrationContext.configure(conn).stamp(script(), "head")


def _migration_engine(url: str) -> Engine:
    """An engine whose transactions cover DDL on SQLite too (pysqlite would autocommit CREATE/ALTER)."""
    from zoo_gym.server.store.engine import make_engine

    if not url.startswith("sqlite"):
        return make_engine(url)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        dbapi_conn.execute("PRAGMA foreign_keys=OFF")  # batch mode copies tables

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def backup_sqlite(db_file: Path, revision: str) -> Path:
    """A consistent copy of a SQLite database (WAL included) beside it, named with its revision."""
    dest = db_file.with_name(f"{db_file.name}.{revision}.bak")
    n = 1
    while dest.exists():
        dest = db_file.with_name(f"{db_file.name}.{revision}.{n}.bak")
        n += 1
    src = sqlite3.connect(str(db_file))
    try:
        out = sqlite3.connect(str(dest))
        try:
            src.backup(out)
        finally:
            out.close()
    finally:
        src.close()
    return dest


def upgrade(url: str, *, empty_ok: bool = False, to: str = "head") -> list[Step]:
    """Apply every pending revision (up to `to`) in one transaction; returns what was applied. `empty_ok`: build
    an empty database from revision 0000 up (tests and `new`; `gym-server init` creates the tables itself)."""
    engine = _migration_engine(url)
    try:
        with engine.begin() as conn:
            steps = pending(conn, empty_ok=empty_ok, to=to)
            if not steps:
                return []
            start = current_revision(conn)
            if start is not None and MigrationContext.configure(conn).get_current_revision() is None:
                MigrationContext.configure(conn).stamp(script(), start)  # an unstamped f956b6f or v0.1.0 database

            def fn(rev, _context):
                return script()._upgrade_revs(to, rev)

            with EnvironmentContext(alembic_config(), script(), fn=fn, destination_rev=to) as env:
                env.configure(connection=conn, target_metadata=target_metadata(), render_as_batch=True)
                with env.begin_transaction():
                    env.run_migrations()
        return steps
    finally:
        engine.dispose()
