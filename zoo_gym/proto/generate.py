"""Regenerate the committed gRPC stubs from gym.proto.

    python -m zoo_gym.proto.generate            # rewrite zoo_gym/proto/gym_pb2*.py(i)
    python -m zoo_gym.proto.generate --out DIR  # write them elsewhere (the staleness test uses this)

Needs grpcio-tools 1.81.x (the `dev` extra), the last on protobuf 6: its 6.x gencode loads on the
protobuf 6 runtime that the `flower` extra pins and on the 7.x a base install gets; 7.x gencode
would not load on 6.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
GENERATED = ("gym_pb2.py", "gym_pb2.pyi", "gym_pb2_grpc.py")
TOOLS_SERIES = "1.81."


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on gym.proto; write the three generated files into `out_dir`."""
    from importlib.metadata import version

    from grpc_tools import protoc  # dev-only dependency, imported on use

    if not (tools := version("grpcio-tools")).startswith(TOOLS_SERIES):
        raise RuntimeError(f"grpcio-tools {tools} found; the stubs need {TOOLS_SERIES}x (see this module)")

    with tempfile.TemporaryDirectory() as tmp:
        # Compile from the repository root so the generated imports read `from zoo_gym.proto import ...`.
        args = [
            "protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / "gym.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on zoo_gym/proto/gym.proto (see its message above)")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(Path(tmp) / "zoo_gym" / "proto" / name, target)
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="directory for the generated files")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
