"""scripts/gpu-check.sh and its helpers, on a machine without a GPU (issue 32: what can be checked here).

The wheel install step on wheels built here into a throwaway target; bitsandbytes' slimming and the
check of the carried set against scripts/gpu-wheels.txt; the JSON writer on a junit file and on a whole
CPU run of the script, where every GPU test skips and the record names the device "cpu" and the commit (a
narrowed rerun writes its own record); the serving benchmark's sweep on the CPU path; and the serving
kernels' dispatch: CPU inputs never import the Triton module (or triton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

from gpu_report import main as report_main, suite_counts  # noqa: E402
from gpu_wheels_slim import check, slim  # noqa: E402


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel `name-version-py3-none-any.whl` holding `files`, its RECORD listing them."""
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(k, v)
    return path


def test_scripts_parse_as_bash():
    for script in ("gpu-check.sh", "gpu-wheels.sh"):
        subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def test_slimmed_bitsandbytes_keeps_cuda_13_and_cpu_and_installs(tmp_path):
    libs = {f"bitsandbytes/libbitsandbytes_{k}.so": b"\0" * 64 for k in ("cpu", "cuda130", "cuda128", "cuda1300x",
                                                                        "rocm64", "xpu2025")}
    whl = _wheel(tmp_path, "bitsandbytes", "0.50.2", {"bitsandbytes/__init__.py": b"", **libs})

    assert slim(whl) == 3  # cuda128, rocm64, xpu2025; a name that only starts like cuda130 is not cuda130
    assert slim(whl) == 0  # already slim

    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    kept = {n for n in names if n.endswith(".so")}
    assert kept == {"bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so",
                    "bitsandbytes/libbitsandbytes_cuda1300x.so"}
    assert {line.split(",")[0] for line in record.splitlines() if line.endswith(".so,,")} == kept
    target = tmp_path / "site"
    env = {**os.environ, "GPU_CHECK_INSTALL_ONLY": "1", "WHEELS": str(tmp_path), "SITE": str(target),
           "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), "cpu"], check=True, env=env, capture_output=True)
    assert (target / "bitsandbytes" / "libbitsandbytes_cuda130.so").is_file()
    assert not (target / "bitsandbytes" / "libbitsandbytes_cuda128.so").exists()


def test_install_step_puts_each_wheel_in_a_throwaway_target(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "zoo_probe_a", "1.0", {"zoo_probe_a.py": b"VALUE = 'a'\n"})
    _wheel(wheels, "zoo_probe_b", "2.0", {"zoo_probe_b/__init__.py": b"VALUE = 'b'\n"})
    target = tmp_path / "site"
    env = {**os.environ, "GPU_CHECK_INSTALL_ONLY": "1", "WHEELS": str(wheels), "SITE": str(target),
           "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable}

    subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), "cpu"], check=True, env=env, capture_output=True)

    out = subprocess.run([sys.executable, "-c", "import zoo_probe_a, zoo_probe_b; print(zoo_probe_a.VALUE + "
                          "zoo_probe_b.VALUE, zoo_probe_a.__file__)"], env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "ab" and out[1].startswith(str(target))


def test_the_carried_set_is_checked_against_the_pins(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("# comment\nzoo-probe-a==1.0\nzoo_probe_b==2.0\n")
    _wheel(tmp_path, "zoo_probe_a", "1.0", {})
    assert check(tmp_path, pins) == ["zoo_probe_b: wanted 2.0, found none"]
    _wheel(tmp_path, "zoo_probe_b", "2.0", {})
    assert check(tmp_path, pins) == []
    _wheel(tmp_path, "zoo_probe_b", "2.1", {})  # two versions of one name stop the install there
    _wheel(tmp_path, "stray", "0.1", {})
    assert check(tmp_path, pins) == ["zoo_probe_b: wanted 2.0, found ['2.0', '2.1']", "stray: not in the list"]
    committed = [ln for ln in (SCRIPTS / "gpu-wheels.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert committed and all(len(ln.split("==")) == 2 for ln in committed)


JUNIT = textwrap.dedent("""\
    <?xml version="1.0" encoding="utf-8"?>
    <testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
    <testcase classname="tests.gpu.test_a" name="test_ok"><properties>
      <property name="triton_vs_cpu_max_abs_diff" value="0.0078125"/><property name="note" value="8 -> 7"/>
    </properties></testcase>
    <testcase classname="tests.gpu.test_a" name="test_bad"><failure message="AssertionError: 3 &gt; 2">long</failure>
    </testcase>
    <testcase classname="tests.gpu.test_b" name="test_err"><error message="fixture broke">x</error></testcase>
    </testsuite></testsuites>
""")


def test_report_counts_and_figures_from_junit(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    counts, figures, failures = suite_counts(junit)
    assert counts == {"passed": 2, "failed": 2, "skipped": 2}
    assert figures == {"triton_vs_cpu_max_abs_diff": 0.0078125, "note": "8 -> 7"}
    assert failures == ["tests.gpu.test_a.test_bad: AssertionError: 3 > 2", "tests.gpu.test_b.test_err: fixture broke"]
    assert suite_counts(tmp_path / "missing.xml")[0] == {"passed": 0, "failed": 0, "skipped": 0}
    bench = tmp_path / "b.json"
    bench.write_text('{"bitdelta_log8_codes": {"vs_base": 0.5}}')
    rec = report_main(["--kind", "nvidia-h200", "--junit", str(junit), "--bench", str(bench), "--extra",
                       "suite_seconds=12", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == rec
    assert rec["kind"] == "nvidia-h200" and rec["suite_seconds"] == 12 and rec["serving"]["bitdelta_log8_codes"]
    assert rec["commit"] == "unknown" and rec["partial"] is False  # not given: said so, not guessed
    assert rec["versions"]["torch"]


@pytest.mark.slow
def test_cpu_run_of_the_check_skips_every_gpu_test_and_says_cpu(tmp_path):
    env = {**os.environ, "WHEELS": str(tmp_path / "none"), "SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out"),
           "RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "gpu-cpu.json").read_text())
    n_gpu = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu",
                            "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True).stdout.count("::")
    assert n_gpu >= 10
    assert rec["device"] == "cpu" and rec["kind"] == "cpu"
    assert rec["tests"] == {"passed": 0, "failed": 0, "skipped": n_gpu}
    assert not (tmp_path / "results" / "gpu-cpu.json").exists()  # only GPU records go to benchmarks/results
    assert "serving" not in rec  # no benchmark without a GPU
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert rec["commit"] in (head, head + "-dirty") and rec["partial"] is False

    # a narrowed rerun (as a device machine runs it: no .git there, the commit passed in) has its own record
    whole = (tmp_path / "out" / "gpu-cpu.json").read_text()
    rerun = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**env, "GPU_CHECK_TESTS": "tests/gpu/test_serving_cuda.py",
                                             "GPU_CHECK_COMMIT": "0123456789e1"})
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    part = json.loads((tmp_path / "out" / "gpu-cpu-partial.json").read_text())
    assert part["partial"] is True and part["commit"] == "0123456789e1"  # a string, never read as a number
    assert 0 < part["tests"]["skipped"] < n_gpu
    assert (tmp_path / "out" / "gpu-cpu.json").read_text() == whole


_DISPATCH = textwrap.dedent("""
    import sys, torch
    from zoo_gym.serving.kernels import bitdelta_linear
    signs = [torch.randint(0, 256, (16, 8), dtype=torch.uint8)]
    y = bitdelta_linear(torch.randn(2, 1, 64), torch.randn(16, 64), None, signs, [torch.rand(16, 1)], 64,
                        torch.tensor([0, -1]))
    print(tuple(y.shape), "zoo_gym.serving.kernels_triton" in sys.modules, "triton" in sys.modules)
""")


def test_cpu_inputs_take_the_cpu_kernel_without_importing_triton():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _DISPATCH], capture_output=True, text=True, check=True, env=env,
                         cwd=ROOT).stdout.split("\n")[-2]
    assert out == "(2, 1, 16) False False"


_COLLECT = textwrap.dedent("""
    import sys, pytest
    rc = pytest.main(["--collect-only", "-q", "tests/gpu", "-p", "no:cacheprovider"])
    print("LOADED", [m for m in ("triton", "bitsandbytes", "opacus", "trl", "peft", "transformers", "zoo_gym.server")
                     if m in sys.modules], rc)
""")


def test_collecting_the_gpu_suite_imports_no_training_or_cuda_package():
    out = subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).stdout
    assert out.split("LOADED")[1].split() == ["[]", "0"], out[-2000:]


@pytest.mark.slow
def test_serving_benchmark_sweeps_variants_against_the_bound_on_the_cpu_path(tmp_path):
    """benchmarks/serving_gpu.py's whole sweep on the CPU path (its smoke run: the figures are no GPU's), so a
    device lease is spent measuring, not mending the script."""
    out = tmp_path / "serving-gpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving_gpu.py"), "--size", "tiny", "--device",
                          "cpu", "--steps", "2", "--repeats", "1", "--batches", "4,16", "--ns", "1,4,16",
                          "--lora-adapters", "16", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(b["batch"], sorted(b["variants"], key=int)) for b in res["batches"]] == [(4, ["1", "4"]),
                                                                                     (16, ["1", "4", "16"])]
    v16 = res["batches"][1]["variants"]["16"]
    assert v16["bound"] == 0.5 and v16["bound_share"] == pytest.approx(v16["vs_base"] / 0.5)
    assert all(v["tokens_differ_from_base"] for b in res["batches"] for v in b["variants"].values())
    assert res["lora"]["adapters"] == 16 and res["lora"]["vs_base"] > 0
    t = res["targets"]
    assert t["bound_share"]["4"] == min(b["variants"]["4"]["bound_share"] for b in res["batches"])
    assert t["bound_share"]["64"] is None and t["met"] is False  # n = 64 was not run: not met
    assert t["lora_16_over_base"] == res["lora"]["vs_base"]
