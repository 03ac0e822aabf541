"""Record what ``benchmarks/gpu_check.sh`` wrote on a GPU machine in ``results/gpu_check.json``.

    python -m benchmarks.gpu_check_record DIR --commit REV [--name gpu_check]

``DIR`` holds the script's files (``summary.txt``, ``pytest_junit.xml``, ``gpu_kernels.json``, ``fit_*.json``). The
record keeps the device and versions, each step's exit status and seconds, every GPU test's outcome (and the first
line of its failure), the kernels benchmark's figures and the two fits' summaries, keyed by the commit that ran, so
that the README's support table can say exactly what ran on CUDA. ``gpu_kernels.json`` is copied to ``results/`` too.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, write_results

STEP = re.compile(r"^step (\S+): exit (\d+) in (\d+) s \(limit (\d+) s\)")


def tests_from_junit(path: Path) -> list[dict[str, Any]]:
    """Every test case of a JUnit report: its node id, outcome and, for a failure, the message's first line."""
    tests = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                text = child.get("message")
                message = text.splitlines()[0][:300] if text else None
        module = case.get("classname", "").replace(".", "/") + ".py"
        tests.append(dict(test=f"{module}::{case.get('name')}", outcome=outcome, seconds=float(case.get("time", 0)),
                          message=message))
    return tests


def record(directory: Path, commit: str) -> dict[str, Any]:
    summary = (directory / "summary.txt").read_text()
    steps = [dict(step=m[1], exit=int(m[2]), seconds=int(m[3]), limit_s=int(m[4]))
             for m in map(STEP.match, summary.splitlines()) if m]
    environment = [line for line in summary.splitlines()[:6] if not STEP.match(line)]
    # every fit the script ran (a step named fit_*), its summary or None where it wrote none
    fits = {s["step"]: json.loads(path.read_text()) if (path := directory / f"{s['step']}.json").exists() else None
            for s in steps if s["step"].startswith("fit_")}
    kernels = directory / "gpu_kernels.json"
    junit = directory / "pytest_junit.xml"
    tests = tests_from_junit(junit) if junit.exists() else []
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return dict(
        commit=commit,
        environment=environment,
        steps=steps,
        tests=counts,
        test_cases=tests,
        kernels=json.loads(kernels.read_text()) if kernels.exists() else None,
        fits=fits,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_record", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="the folder gpu_check.sh wrote ($OUT)")
    parser.add_argument("--commit", required=True, help="the commit the GPU machine ran")
    parser.add_argument("--name", default="gpu_check", help="results/NAME.json (default gpu_check)")
    args = parser.parse_args()
    payload = record(args.directory, args.commit)
    if (args.directory / "gpu_kernels.json").exists():
        shutil.copyfile(args.directory / "gpu_kernels.json", RESULTS_DIR / "gpu_kernels.json")
    path = write_results(args.name, payload)
    print(f"{payload['tests']} | steps: " + ", ".join(f"{s['step']} exit {s['exit']}" for s in payload["steps"]))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
