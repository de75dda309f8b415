"""The GPU check's record (scripts/gpu-check.sh): one JSON of the card, the suite's counts and the figures.

    gpu_report.py --kind KIND --junit SUITE.xml [--bench SERVING.json] [--commit SHA] [--partial]
                  [--extra K=V ...] --out FILE

Counts come from pytest's junit XML (its <testsuite> attributes; no plugin): passed, failed (failures +
errors), skipped; with each failed test's first message line. Figures: every `record_property` of the
suite's tests, and the serving benchmark's JSON under "serving". `device` is the name torch gives the
first CUDA device, or "cpu" where there is none; `versions`, those of the packages the suite ran with;
`commit`, the code it ran (a string, as given); `partial`, whether the suite or the benchmark was narrowed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import xml.etree.ElementTree as ET
from pathlib import Path


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def suite_counts(junit: Path) -> tuple[dict, dict, list[str]]:
    """({passed, failed, skipped}, {property: value}, ["test: message", ...] of failures) from a junit file;
    all zero, with the reason as a failure, when the file is missing or unreadable (the suite did not finish)."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"passed": 0, "failed": 0, "skipped": 0}, {}, [f"no junit XML ({type(exc).__name__}: {exc})"]
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = n["failures"] + n["errors"]
    props, failures = {}, []
    for case in root.iter("testcase"):
        for p in case.iter("property"):
            props[p.get("name")] = _number(p.get("value", ""))
        for bad in [*case.findall("failure"), *case.findall("error")]:
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}.{case.get('name')}: {first[0][:300] if first else ''}")
    return {"passed": n["tests"] - failed - n["skipped"], "failed": failed, "skipped": n["skipped"]}, props, failures


PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "trl", "datasets", "bitsandbytes", "opacus",
            "grpcio", "protobuf", "sqlmodel", "cryptography", "numba", "numpy", "pyarrow", "huggingface-hub")


def versions() -> dict:
    """Installed version of each of PACKAGES (None when missing), as the suite ran with them."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", required=True)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--bench", type=Path, default=None)
    ap.add_argument("--commit", default="unknown", help="the commit the check ran (kept as a string)")
    ap.add_argument("--partial", action="store_true", help="the suite or the benchmark was narrowed")
    ap.add_argument("--extra", action="append", default=[], help="KEY=VALUE recorded as is (seconds, versions)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    counts, figures, failures = suite_counts(a.junit)
    rec = {"kind": a.kind, "commit": a.commit, "partial": a.partial, "device": device_name(),
           "python": platform.python_version(), "tests": counts,
           "failures": failures, "figures": figures, "versions": versions()}
    if a.bench is not None:
        try:
            rec["serving"] = json.loads(a.bench.read_text())
        except (OSError, ValueError) as exc:
            rec["serving"] = {"error": f"{type(exc).__name__}: {exc}"}
    for kv in a.extra:
        key, _, value = kv.partition("=")
        rec[key] = _number(value)
    a.out.write_text(json.dumps(rec, indent=2) + "\n")
    return rec


if __name__ == "__main__":
    print(json.dumps(main()["tests"]))
