"""The carried wheels for the GPU machine (scripts/gpu-wheels.sh): slim bitsandbytes, check the set.

``gpu_wheels_slim.py DIR`` rewrites DIR's bitsandbytes wheel without the native libraries torch +cu130 never
loads (other CUDA versions, ROCm, XPU: 121 of its 129 MB), its RECORD updated; a no-op when already slim.
``gpu_wheels_slim.py --check DIR LIST`` exits 1 unless DIR holds exactly one wheel per `name==version` line
of LIST, at that version, and nothing else (two versions of one name would stop the install there).
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

KEEP_CUDA = "130"  # torch 2.11+cu130 on the GPU machine (KINDS.md)
_DROP = re.compile(rf"bitsandbytes/libbitsandbytes_(cuda(?!{KEEP_CUDA}\.)\d+|rocm\d+|xpu\d+)\.so$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def slim(wheel: Path) -> int:
    """Rewrite `wheel` without the libraries _DROP matches; returns how many it dropped."""
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        drop = {i.filename for i in infos if _DROP.search(i.filename)}
        if not drop:
            return 0
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for i in infos:
                if i.filename in drop:
                    continue
                data = z.read(i.filename)
                if i.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = ("\n".join(ln for ln in lines if ln.split(",")[0] not in drop) + "\n").encode()
                out.writestr(i, data)
    tmp.replace(wheel)
    return len(drop)


def check(folder: Path, pins: Path) -> list[str]:
    """Problems with `folder`'s wheels against the `name==version` lines of `pins` (empty: none)."""
    want = {}
    for line in pins.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            want[_norm(name)] = version
    have: dict[str, list[str]] = {}
    for w in sorted(folder.glob("*.whl")):
        name, version = w.name.split("-")[:2]
        have.setdefault(_norm(name), []).append(version)
    problems = [f"{n}: wanted {v}, found {have.get(n) or 'none'}" for n, v in want.items() if have.get(n) != [v]]
    return problems + [f"{n}: not in the list" for n in have if n not in want]


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        bad = check(Path(sys.argv[2]), Path(sys.argv[3]))
        print("\n".join(bad) or "wheels: one per pinned name, as pinned")
        sys.exit(1 if bad else 0)
    for w in Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
        print(f"{w.name}: dropped {slim(w)} native libraries for other accelerators")
