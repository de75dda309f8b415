"""The committed stubs are what gym.proto generates, and every field is documented."""

import re
from pathlib import Path

import pytest

from zoo_gym.proto import generate

pytest.importorskip("grpc_tools")


def test_committed_stubs_are_fresh(tmp_path):
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (generate.PROTO_DIR / name).read_text()
        assert fresh == committed, f"zoo_gym/proto/{name} is stale: run `python -m zoo_gym.proto.generate`"


def test_every_field_is_documented():
    lines = (generate.PROTO_DIR / "gym.proto").read_text().splitlines()
    field = re.compile(r"^\s+(repeated\s+)?[A-Za-z0-9_.]+\s+\w+\s*=\s*\d+;")
    undocumented = []
    for i, line in enumerate(lines):
        if field.match(line) and "UNSPECIFIED" not in line:
            # a field is documented by a comment on one of the lines above it, within its message
            above = lines[max(0, i - 4) : i]
            if not any(l.strip().startswith("//") for l in above):
                undocumented.append(line.strip())
    assert undocumented == [], f"fields without a comment: {undocumented}"
