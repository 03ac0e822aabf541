"""benchmarks/gpu_check.sh (tried on the CPU, as its docstring says) and the record made of its files."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks.gpu_check_record import record
from tests.paths import ROOT

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_gpu" name="test_a[torch]" time="0.5"/>
<testcase classname="tests.gpu.test_gpu" name="test_b" time="1.0"><failure message="AssertionError: 3 differ&#10;more">x</failure></testcase>
<testcase classname="tests.gpu.test_nccl" name="test_c" time="0.0"><skipped message="needs 2 GPUs"/></testcase>
</testsuite></testsuites>"""


def test_record_reads_steps_tests_and_fits(tmp_path):
    (tmp_path / "summary.txt").write_text(
        "Sat Nov 28\nNVIDIA H200, 143771 MiB\npython 3.12.3 | torch 2.11.0\n"
        "step gpu_suite: exit 1 in 114 s (limit 200 s)\nstep fit_one_gpu: exit 0 in 37 s (limit 90 s)\n"
        "step fit_two_processes: exit 124 in 200 s (limit 200 s): TIMED OUT\nsteps failed: 2\n"
    )
    (tmp_path / "pytest_junit.xml").write_text(JUNIT)
    (tmp_path / "fit_one_gpu.json").write_text(json.dumps({"steps": 300, "stage": "compression"}))
    r = record(tmp_path, "abc1234")
    assert r["commit"] == "abc1234" and "NVIDIA H200, 143771 MiB" in r["environment"]
    assert [(s["step"], s["exit"], s["seconds"]) for s in r["steps"]] == [
        ("gpu_suite", 1, 114), ("fit_one_gpu", 0, 37), ("fit_two_processes", 124, 200)]
    assert r["tests"] == {"passed": 1, "failed": 1, "skipped": 1}
    failed = [t for t in r["test_cases"] if t["outcome"] == "failed"]
    assert failed == [dict(test="tests/gpu/test_gpu.py::test_b", outcome="failed", seconds=1.0,
                           message="AssertionError: 3 differ")]
    assert r["fits"] == {"fit_one_gpu": {"steps": 300, "stage": "compression"}, "fit_two_processes": None}


@pytest.mark.slow
def test_the_script_runs_its_fits_on_the_cpu(tmp_path):
    """The fits of gpu_check.sh on the CPU: 1-bit Adam in one process, then two over gloo (3 steps each); local steps
    on two, onebit_fsdp and the sharded local steps on four (8 steps each, a sync every ``DEFAULTS.sync_every``, the
    configs'); about 3 minutes."""
    from lightning_onebit.strategy.local_steps_run import DEFAULTS

    env = dict(os.environ, ACCELERATOR="cpu", PRECISION="32", MAX_STEPS="3", SHORT_STEPS="8", OUT=str(tmp_path),
               PYTHON="python")
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("fit_one_gpu", "fit_two_processes"):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        assert summary["steps"] == 3 and summary["stage"] == "compression", summary
    summary = json.loads((tmp_path / "fit_fsdp.json").read_text())
    assert summary["steps"] == 8 and summary["strategy"] == "OnebitFSDPStrategy", summary
    for name, strategy in (("fit_diloco", "OnebitDiLoCoStrategy"), ("fit_diloco_fsdp", "OnebitDiLoCoFSDPStrategy")):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        syncs = -(-8 // DEFAULTS.sync_every)  # every whole period, and the end of fit's for any steps left
        assert summary["steps"] == 8 and summary["strategy"] == strategy and summary["outer_syncs"] == syncs, summary
