"""zoo-gym installs and imports without flwr; only the Flower adapter needs the `flower` extra.

Builds the wheel from a copy of the source (offline, no build isolation), installs it with
`pip --no-index --no-deps` into a fresh venv that sees this environment's packages except flwr
and zoo-gym itself, then checks the wheel's requirements and imports every zoo_gym module there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytest.importorskip("setuptools")  # the build backend, run without isolation (offline)

REPO = Path(__file__).resolve().parent.parent
MESSAGE = "zoo_gym.integrations.flower.strategy needs Flower: pip install 'zoo-gym[flower]'"

WALK = textwrap.dedent("""
    import importlib, importlib.util, json, pkgutil, sys, traceback
    from importlib import metadata
    import zoo_gym
    out = {"zoo_gym": zoo_gym.__file__, "flwr_spec": importlib.util.find_spec("flwr") is not None,
           "requires": metadata.requires("zoo-gym") or [], "ok": [], "failed": {}}
    for info in pkgutil.walk_packages(zoo_gym.__path__, "zoo_gym."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
            out["ok"].append(info.name)
        except BaseException as exc:
            out["failed"][info.name] = "".join(traceback.format_exception(exc))
    print(json.dumps(out))
""")


def _hidden_entries(site_dirs: list[str]) -> set[str]:
    """Site-packages entries of flwr and of zoo-gym itself (any install of it: editable or not)."""
    hidden = set()
    for dist in metadata.distributions(path=site_dirs):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") in ("flwr", "zoo-gym"):
            hidden |= {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
    return hidden


def _run(args, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=90, env=env, **kw)
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "zoo_gym", src / "zoo_gym",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    dist = tmp / "dist"
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(dist)!r})"],
         cwd=src)
    (wheel,) = dist.glob("zoo_gym-*.whl")
    return wheel


def _venv_without_flwr(tmp: Path) -> Path:
    """A fresh venv that sees this environment's packages, less flwr's and zoo-gym's entries.

    They are linked into a directory OUTSIDE the venv, added as a site dir by a .pth file: pip
    installs into the venv only and never uninstalls or writes anything through the links.
    """
    venv, deps = tmp / "venv", tmp / "deps"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
                     ).stdout.strip())
    sources = sorted({os.path.realpath(sysconfig.get_path(k)) for k in ("purelib", "platlib")})
    hidden = _hidden_entries(sources)
    deps.mkdir()
    for source in sources:
        for entry in Path(source).iterdir():
            name = entry.name
            if (name in hidden or name == "__pycache__" or name == "flwr" or name.startswith("flwr-")
                    or "zoo_gym" in name or (deps / name).exists()):
                continue
            (deps / name).symlink_to(entry)
    (site / "zz_deps.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    return python


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_installs_and_imports_without_flwr(tmp_path):
    wheel = _build_wheel(tmp_path)
    python = _venv_without_flwr(tmp_path)
    _run([str(python), "-I", "-B", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
          "--disable-pip-version-check", str(wheel)])
    (tmp_path / "walk.py").write_text(WALK)
    out = json.loads(_run([str(python), "-I", "-B", str(tmp_path / "walk.py")], cwd=tmp_path).stdout)

    # the package under test is the installed wheel, and flwr is really absent
    assert Path(out["zoo_gym"]).is_relative_to(tmp_path / "venv"), out["zoo_gym"]
    assert not out["flwr_spec"], "flwr is importable in the venv that should lack it"

    # wheel metadata: flwr only behind an extra, `flower` among them; protobuf 7 and grpcio 1.82+ allowed
    reqs = [Requirement(r) for r in out["requires"]]
    flwr = [r for r in reqs if r.name == "flwr"]
    base = {r.name: r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert flwr and "flwr" not in base, out["requires"]
    assert any(r.marker is not None and r.marker.evaluate({"extra": "flower"}) for r in flwr)
    assert base["protobuf"].specifier.contains("7.0.0"), base["protobuf"]
    for name in ("grpcio-health-checking", "grpcio-reflection"):
        assert base[name].specifier.contains("1.82.0"), base[name]

    # the adapter and the apps fail with one line naming the extra, nothing chained
    for module in ("zoo_gym.integrations.flower.strategy", "zoo_gym.integrations.flower.apps"):
        flower = out["failed"].pop(module, "")
        assert flower.rstrip().splitlines()[-1] == f"ImportError: {MESSAGE.replace(MESSAGE.split()[0], module)}", flower
        assert "During handling" not in flower and "direct cause" not in flower, flower
        assert module not in out["ok"]

    # everything else imports, or fails for reasons of its own (triton on CPU, alembic's env.py), never flwr
    assert len(out["ok"]) > 50, out["ok"]
    for name in ("zoo_gym.aggregation", "zoo_gym.server.cli", "zoo_gym.client.cli", "zoo_gym.demo"):
        assert name in out["ok"], out["failed"].get(name)
    for name, tb in out["failed"].items():
        assert "flwr" not in tb and "zoo-gym[flower]" not in tb, f"{name} needs flwr:\n{tb}"
