"""Databases for the tests: SQLite, and a real PostgreSQL server started once per test session.

A module opts in to both with ``DATABASES = ("sqlite", "postgresql")``: its tests that use the ``db_url``
fixture (or ``db_backend`` with ``new_database``, for module-scoped fixtures) then run once per database.
Elsewhere ``db_url`` is None: the state directory's own SQLite file.

PostgreSQL: ``initdb`` and ``pg_ctl`` of Debian's ``postgresql`` package (/usr/lib/postgresql/*/bin) in a
temporary directory, on a free port of 127.0.0.1, as the user ``nobody`` when the tests run as root
(PostgreSQL refuses root), with fsync off (a test server). Each ``db_url`` is a new database on it. Without
the binaries or the psycopg driver the PostgreSQL parameters fail when CI=true and skip otherwise.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

PG_USER = "nobody"  # when running as root


def pytest_generate_tests(metafunc):
    if "db_backend" in metafunc.fixturenames:
        backends = getattr(metafunc.module, "DATABASES", None)
        if backends:
            metafunc.parametrize("db_backend", backends, indirect=True, scope="module")


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", PG_USER, "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="session")
def postgres_server():
    """The URL of a PostgreSQL server (user postgres, trust auth on 127.0.0.1), stopped after the session."""
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not bins and shutil.which("pg_ctl"):
        bins = [shutil.which("pg_ctl")]
    if not bins:
        _unavailable("PostgreSQL is not installed (apt-get install postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("the psycopg driver is not installed (pip install -e '.[postgres]')")
    bindir = Path(bins[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="zoo-gym-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, PG_USER)
    data, port = root / "data", _free_port()
    try:
        subprocess.run(_as_server_user([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                        "-E", "UTF8", "--no-sync"]), check=True, capture_output=True, timeout=120)
        subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w",
                                        "-t", "60", "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 "
                                        "-c fsync=off -c synchronous_commit=off -c full_page_writes=off", "start"]),
                       check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log = (root / "log").read_text()[-2000:] if (root / "log").is_file() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"PostgreSQL did not start: {exc}: {getattr(exc, 'stderr', b'')!r} {log}", pytrace=False)
    yield f"postgresql://postgres@127.0.0.1:{port}"
    subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                   capture_output=True, timeout=120)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def new_database(request):
    """`new_database(backend)`: None for "sqlite" (the state directory's own file), else the URL of a new,
    empty PostgreSQL database."""
    counter = itertools.count(1)

    def make(backend: str) -> str | None:
        if backend == "sqlite":
            return None
        assert backend == "postgresql", backend
        server = request.getfixturevalue("postgres_server")
        import psycopg

        name = f"zoo_gym_{os.getpid()}_{next(counter)}"
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{server}/{name}"

    return make


@pytest.fixture(scope="module")
def db_backend(request) -> str:
    return getattr(request, "param", "sqlite")


@pytest.fixture
def db_url(db_backend, new_database) -> str | None:
    return new_database(db_backend)


def pytest_collection_modifyitems(config, items):
    """`real_model` tests load the real built-in base (a 92 MB wheel, 538 MB converted): opt-in only."""
    if os.environ.get("ZOO_GYM_REAL_MODEL") == "1":
        return
    skip = pytest.mark.skip(reason="loads the real model smollm2-135m: set ZOO_GYM_REAL_MODEL=1 to run")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_network(monkeypatch):
    """`gym-client join` in this test must fail before it contacts a server or touches a key."""
    from zoo_gym.client import join as join_module

    def refuse(*a, **k):
        raise AssertionError("the server was contacted")

    monkeypatch.setattr(join_module, "Servers", refuse)  # join's channels to the server's addresses
    monkeypatch.setattr(join_module.signing, "load_or_create_key", refuse)
