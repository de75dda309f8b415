"""`python -m zoo_gym.server.store.migrations new "what changed"`: write the next revision by comparing the table
models with a scratch SQLite database upgraded to the head. Review the file before committing it; on
PostgreSQL an Enum change also needs its ALTER TYPE written by hand."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine

from zoo_gym.server.store import migrations


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "new":
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'head.db'}"
        migrations.upgrade(url, empty_ok=True)
        engine = create_engine(url)
        cfg = migrations.alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            rev_id = f"{int(migrations.head()) + 1:04d}"
            script = command.revision(cfg, message=argv[1], autogenerate=True, rev_id=rev_id)
        engine.dispose()
    print(f"wrote {script.path}: review it, then run tests/server/test_migrations.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
