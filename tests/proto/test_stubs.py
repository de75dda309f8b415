"""The committed stubs are what gym.proto generates, every field is documented, and the base
install's protobuf and grpcio floors are not older than the stubs' generated code."""

import re
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from zoo_gym.proto import generate

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _tools_version() -> str | None:
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return None


@pytest.mark.skipif(not (_tools_version() or "").startswith(generate.TOOLS_SERIES),
                    reason=f"needs grpcio-tools {generate.TOOLS_SERIES}x (the dev extra)")
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


def test_base_floors_admit_the_stubs():
    """New gencode on an older runtime never loads: protobuf >= the gencode, grpcio >= the grpc stub's."""
    stub = (generate.PROTO_DIR / "gym_pb2.py").read_text()
    gencode = Version(re.search(r"^# Protobuf Python Version: (\S+)$", stub, re.M).group(1))
    grpc_stub = (generate.PROTO_DIR / "gym_pb2_grpc.py").read_text()
    grpc_gen = Version(re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", grpc_stub, re.M).group(1))
    deps = tomllib.loads((generate.REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {r.name: r for r in map(Requirement, deps)}
    for name, generated in (("protobuf", gencode), ("grpcio", grpc_gen)):
        floors = [Version(s.version) for s in reqs[name].specifier if s.operator == ">="]
        assert floors and max(floors) >= generated, f"{name} {reqs[name].specifier} admits older than {generated}"
    # the runtime one major newer also loads this gencode: base installs (no flwr) get protobuf 7
    assert reqs["protobuf"].specifier.contains(f"{gencode.major + 1}.0.0")
