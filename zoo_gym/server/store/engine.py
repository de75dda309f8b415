"""SQLAlchemy engines for the server's database: SQLite (durable, WAL) or PostgreSQL through psycopg 3."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import create_engine


def make_engine(url: str) -> Engine:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        # SQLAlchemy's default PostgreSQL driver is psycopg2; the `postgres` extra installs psycopg 3
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
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
