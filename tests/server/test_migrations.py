"""Schema migrations (issue 18 item 1) on SQLite and PostgreSQL.

tests/fixtures/state-v0.1.0 was written by the first release's own code (tests/fixtures/make_v0_1_0_state.py:
two real clients, round 1 published, a verified ledger). The current code refuses it until `gym-server
migrate` upgrades it; then it serves round 2 on round 1's checkpoint and the ledger, old entries and new,
still verifies. On PostgreSQL the same rows are loaded into a database with v0.1.0's schema (revision 0001,
no version table, as v0.1.0 leaves it) first.

tests/fixtures/state-f956b6f (and -postgresql, a pg_dump) were written by the first code users ran, commit
f956b6f (tests/fixtures/make_f956b6f_state.py), whose schema has no roundinputs table (revision 0000): the same
upgrade, checks and next round.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors import safe_open
from sqlalchemy import MetaData, create_engine, inspect, select, text
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.server.store import migrations
from zoo_gym.server.cli import app
from zoo_gym.server.store.engine import make_engine

DATABASES = ("sqlite", "postgresql")  # tests using `db_url` run on each (tests/conftest.py)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state-v0.1.0"
MADE_BY = json.loads((FIXTURE / "made_by.json").read_text())


def _cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def _scratch_url(tmp_path: Path, db_url: str | None) -> str:
    return db_url or f"sqlite:///{tmp_path / 'scratch.db'}"


def test_the_models_and_the_migrations_head_agree(tmp_path, db_url):
    """A model changed without a migration fails here: write one with
    `python -m zoo_gym.server.store.migrations new "what changed"`, review it, commit it."""
    url = _scratch_url(tmp_path, db_url)
    applied = migrations.upgrade(url, empty_ok=True)
    assert [s.revision for s in applied][0] == migrations.ROOT and applied[-1].revision == migrations.head()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                    migrations.target_metadata())
            assert migrations.pending(conn) == []
    finally:
        engine.dispose()
    assert diff == [], f"the table models differ from migration {migrations.head()}: {diff}"


def test_the_baseline_revision_is_the_schema_v0_1_0_wrote(tmp_path):
    """Revision 0001, applied to an empty SQLite file, gives the tables, columns, keys and indexes that
    v0.1.0's `gym-server init` wrote into the fixture."""
    url = _scratch_url(tmp_path, None)
    migrations.upgrade(url, empty_ok=True, to=migrations.BASELINE)
    shutil.copyfile(FIXTURE / "server.db", tmp_path / "released.db")  # never open the fixture itself
    baseline, released = create_engine(url), create_engine(f"sqlite:///{tmp_path / 'released.db'}")
    try:
        made = MetaData()
        made.reflect(baseline)
        made.remove(made.tables["alembic_version"])
        with released.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), made)
            assert sorted(inspect(conn).get_table_names()) == sorted(made.tables)
    finally:
        baseline.dispose()
        released.dispose()
    assert diff == []


def _load_fixture(tmp_path: Path, db_url: str | None) -> Path:
    """A copy of the v0.1.0 state directory; on PostgreSQL its database's rows in a v0.1.0-schema database."""
    state = tmp_path / "state"
    shutil.copytree(FIXTURE, state)
    if db_url is None:
        return state
    migrations.upgrade(db_url, empty_ok=True, to=migrations.BASELINE)
    src, dst = create_engine(f"sqlite:///{state / 'server.db'}"), make_engine(db_url)
    try:
        with dst.begin() as conn:
            conn.execute(text("DROP TABLE alembic_version"))  # v0.1.0 had none
        src_meta, dst_meta = MetaData(), MetaData()
        src_meta.reflect(src)
        dst_meta.reflect(dst)
        with src.connect() as s, dst.begin() as d:
            for table in dst_meta.sorted_tables:
                rows = [dict(r) for r in s.execute(select(src_meta.tables[table.name])).mappings()]
                if rows:
                    d.execute(table.insert(), rows)
                for col in table.primary_key.columns:  # serial columns continue after the copied ids
                    seq = d.execute(text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table.name,
                                                                                    "c": col.name}).scalar()
                    if seq and rows:
                        d.execute(text(f"SELECT setval('{seq}', (SELECT max({col.name}) FROM \"{table.name}\"))"))
    finally:
        src.dispose()
        dst.dispose()
    (state / "server.db").unlink()
    meta = json.loads((state / "state.json").read_text())
    (state / "state.json").write_text(json.dumps({**meta, "db_url": db_url}))
    return state


def _serve_round_2(state_dir: Path, base_sha256: str = MADE_BY["round_1_checkpoint"]) -> None:
    """Round 2 on the migrated state: an in-process server, two new contributors, until it is published."""
    from zoo_gym.server.config import build_config
    from zoo_gym.server.store.models import Round, RoundState
    from zoo_gym.server.transport.servicer import build_server
    from zoo_gym.server.store.state import open_state

    import grpc

    state = open_state(state_dir, exclusive=True)
    config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600,
                          reward_pool=1000)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = gym_pb2_grpc.GymStub(channel)
        info = stub.GetRound(gym_pb2.GetRoundRequest())
        assert (info.round_id, info.base_sha256) == (2, base_sha256)
        with safe_open(str(state.checkpoint_dir(info.base_sha256) / "model.safetensors"), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        names = [k for k, s in shapes.items() if len(s) == 2][:3]
        for seed in range(2):
            key = Ed25519PrivateKey.generate()
            cid = stub.Register(register_request(key, f"after-upgrade-{seed}")).contributor_id
            g = torch.Generator().manual_seed(seed)
            payload = codec.encode({k: torch.randn(shapes[k], generator=g) * 1e-3 for k in names}, codec="bitdelta")
            header = build_header(key=key, contributor_id=cid, round_id=2, base_sha256=info.base_sha256,
                                  payload=payload, metadata={})
            stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with state.session() as s:
                if s.get(Round, 2).state == RoundState.PUBLISHED:
                    return
            time.sleep(0.2)
        raise AssertionError("round 2 was not published")
    finally:
        channel.close()
        server.stop(grace=None)
        rounds.stop()
        state.engine.dispose()
        state.lock.release()


def test_a_v0_1_0_state_is_refused_then_migrated_and_serves_the_next_round(tmp_path, db_url):
    state = _load_fixture(tmp_path, db_url)
    line = _one_line_error(_cli("status", "--state-dir", state))
    assert "schema revision 0001" in line and "gym-server migrate" in line

    dry = _cli("migrate", "--state-dir", state, "--dry-run")
    assert dry.exit_code == 0 and "revision 0001" in dry.output and migrations.head() in dry.output, dry.output
    assert "gym-server migrate" in _one_line_error(_cli("status", "--state-dir", state))  # nothing changed

    done = _cli("migrate", "--state-dir", state)
    assert done.exit_code == 0 and f"migrated {state} to revision {migrations.head()}" in done.output, done.output
    if db_url is None:  # the untouched v0.1.0 database, named with its revision
        backup = state / "server.db.0001.bak"
        assert f"backed up the database to {backup}" in done.output
        with create_engine(f"sqlite:///{backup}").connect() as conn:
            assert migrations.current_revision(conn) == "0001"
            assert not inspect(conn).has_table("alembic_version")
    assert "nothing to migrate" in _cli("migrate", "--state-dir", state).output

    status = _cli("status", "--state-dir", state, "--json")
    assert status.exit_code == 0, status.output
    doc = json.loads(status.output)
    assert doc["round"]["id"] == 2 and doc["rounds"][0]["state"] == "published"
    verified = _cli("ledger", "verify", "--state-dir", state)
    assert verified.exit_code == 0 and "ledger OK: 2 entries" in verified.output, verified.output
    before = json.loads(_cli("ledger", "show", "--state-dir", state, "--json").output)
    assert before == MADE_BY["ledger"]  # balances and hashes exactly as v0.1.0 printed them

    _serve_round_2(state)

    after = json.loads(_cli("ledger", "show", "--state-dir", state, "--json").output)
    assert after[:2] == MADE_BY["ledger"] and len(after) == 4 and {e["round_id"] for e in after[2:]} == {2}
    verified = _cli("ledger", "verify", "--state-dir", state)
    assert verified.exit_code == 0 and "ledger OK: 4 entries" in verified.output, verified.output


F956B6F = Path(__file__).resolve().parents[1] / "fixtures" / "state-f956b6f"
F956B6F_PG = Path(__file__).resolve().parents[1] / "fixtures" / "state-f956b6f-postgresql"


def _load_f956b6f(tmp_path: Path, db_url: str | None) -> tuple[Path, dict]:
    """A copy of the state directory f956b6f's code wrote (tests/fixtures/make_f956b6f_state.py) and its
    made_by.json; on PostgreSQL f956b6f's own database (its pg_dump) restored into `db_url`."""
    state = tmp_path / "state"
    if db_url is None:
        shutil.copytree(F956B6F, state)
        return state, json.loads((F956B6F / "made_by.json").read_text())
    import psycopg

    shutil.copytree(F956B6F_PG, state, ignore=shutil.ignore_patterns("database.sql"))
    dump = (F956B6F_PG / "database.sql").read_text()
    sql = "\n".join(line for line in dump.splitlines() if not line.startswith("\\"))  # psql's meta-commands
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql)
    meta = json.loads((state / "state.json").read_text())
    (state / "state.json").write_text(json.dumps({**meta, "db_url": db_url}))
    return state, json.loads((F956B6F_PG / "made_by.json").read_text())


def test_the_root_revision_is_the_schema_f956b6f_wrote(tmp_path, db_url, db_backend, new_database):
    """Revision 0000, applied to an empty database, gives the tables, columns, keys and indexes that f956b6f's
    `gym-server init` and one published round left in the fixture (its SQLite file, or its pg_dump restored)."""
    url = new_database(db_backend) or _scratch_url(tmp_path, None)
    migrations.upgrade(url, empty_ok=True, to=migrations.ROOT)
    state, _ = _load_f956b6f(tmp_path, db_url)  # a copy: never open the fixture itself
    root, released = make_engine(url), make_engine(db_url or f"sqlite:///{state / 'server.db'}")
    try:
        made = MetaData()
        made.reflect(root)
        made.remove(made.tables["alembic_version"])
        with released.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), made)
            assert sorted(inspect(conn).get_table_names()) == sorted(made.tables)
            assert migrations.current_revision(conn) == migrations.ROOT
    finally:
        root.dispose()
        released.dispose()
    assert diff == []


def test_a_f956b6f_state_is_migrated_and_serves_the_next_round(tmp_path, db_url):
    """The first code users ran (f956b6f) wrote no roundinputs table: `gym-server migrate` takes its state to the
    head, keeps every round, checkpoint and ledger entry, and the next round is served and paid on it."""
    state, made_by = _load_f956b6f(tmp_path, db_url)
    line = _one_line_error(_cli("status", "--state-dir", state))
    assert "schema revision 0000" in line and "gym-server migrate" in line

    done = _cli("migrate", "--state-dir", state)
    assert done.exit_code == 0 and f"migrated {state} to revision {migrations.head()}" in done.output, done.output
    if db_url is None:
        assert f"backed up the database to {state / 'server.db.0000.bak'}" in done.output
    assert "nothing to migrate" in _cli("migrate", "--state-dir", state).output

    status = _cli("status", "--state-dir", state, "--json")
    assert status.exit_code == 0, status.output
    doc = json.loads(status.output)
    assert doc["round"]["id"] == 2 and {r["id"]: r["state"] for r in doc["rounds"]} == {1: "published", 2: "open"}
    assert {c["round"]: c["sha256"] for c in doc["checkpoints"]}[1] == made_by["round_1_checkpoint"]
    verified = _cli("ledger", "verify", "--state-dir", state)
    assert verified.exit_code == 0 and "ledger OK: 2 entries" in verified.output, verified.output
    assert json.loads(_cli("ledger", "show", "--state-dir", state, "--json").output) == made_by["ledger"]

    _serve_round_2(state, made_by["round_1_checkpoint"])

    after = json.loads(_cli("ledger", "show", "--state-dir", state, "--json").output)
    assert after[:2] == made_by["ledger"] and len(after) == 4 and {e["round_id"] for e in after[2:]} == {2}
    verified = _cli("ledger", "verify", "--state-dir", state)
    assert verified.exit_code == 0 and "ledger OK: 4 entries" in verified.output, verified.output


FAILING_REVISION = """
import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = "9000", {head!r}, None, None


def upgrade():
    op.create_table("half_done", sa.Column("x", sa.Integer(), primary_key=True))
    with op.batch_alter_table("round") as batch:
        batch.add_column(sa.Column("half_done", sa.Integer(), nullable=True))
    raise RuntimeError("a revision that fails half way")
"""


def test_a_migration_that_fails_half_way_leaves_the_database_as_it_was(tmp_path, db_url, monkeypatch):
    """The pending revisions run in one transaction, DDL included (SQLite too): a failure rolls back the
    revisions before it and its own half, so the database stays at v0.1.0 and can be migrated again."""
    from alembic.script import ScriptDirectory

    state = _load_fixture(tmp_path, db_url)
    scripts = tmp_path / "migrations"
    shutil.copytree(migrations.MIGRATIONS_DIR, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9000_fails.py").write_text(FAILING_REVISION.format(head=migrations.head()))
    monkeypatch.setattr(migrations, "script", lambda: ScriptDirectory(str(scripts)))

    with pytest.raises(RuntimeError, match="fails half way"):
        migrations.upgrade(db_url or f"sqlite:///{state / 'server.db'}")
    engine = make_engine(db_url or f"sqlite:///{state / 'server.db'}")
    try:
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
            columns = {c["name"] for c in inspect(conn).get_columns("round")}
            assert migrations.current_revision(conn) == migrations.BASELINE
    finally:
        engine.dispose()
    assert "half_done" not in names and "half_done" not in columns and "alembic_version" not in names
    assert "spentinvite" not in names  # 0002 ran before the failure and was rolled back with it


def test_init_stamps_the_head_and_refuses_a_database_holding_a_federation(tmp_path, db_url):
    url = db_url or f"sqlite:///{tmp_path / 'shared.db'}"
    first = _cli("init", "--state-dir", tmp_path / "first", "--db", url)
    assert first.exit_code == 0, first.output
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == migrations.head()
    finally:
        engine.dispose()
    line = _one_line_error(_cli("init", "--state-dir", tmp_path / "second", "--db", url))
    assert "already holds a federation" in line
    assert not (tmp_path / "second").exists()


def test_a_database_from_a_newer_zoo_gym_is_refused(tmp_path):
    assert _cli("init", "--state-dir", tmp_path / "s").exit_code == 0
    with create_engine(f"sqlite:///{tmp_path / 's' / 'server.db'}").begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    line = _one_line_error(_cli("status", "--state-dir", tmp_path / "s"))
    assert "9999" in line and "newer" in line


def test_postgresql_without_its_driver_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['psycopg'] = None; sys.modules['psycopg2'] = None\n"
            "from zoo_gym.server.cli import app; app()")
    res = subprocess.run([sys.executable, "-c", code, "init", "--state-dir", str(tmp_path / "s"), "--db",
                          "postgresql://gym@127.0.0.1:1/gym"], capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "pip install 'zoo-gym[postgres]'" in lines[0]
    assert not (tmp_path / "s").exists()
