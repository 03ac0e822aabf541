"""examples/minimal.py: run as a user would, it trains on 2 gloo CPU processes and reaches the compression stage."""

import re
import subprocess
import sys

from tests.paths import MINIMAL_EXAMPLE, script_env


def test_minimal_example_runs_on_two_cpu_processes_and_reaches_the_compression_stage(tmp_path):
    proc = subprocess.run([sys.executable, str(MINIMAL_EXAMPLE)], cwd=tmp_path, env=script_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # its last line, from rank 0 only: loss, stage and bytes against DDP
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("train_loss ")]
    found = re.search(r"train_loss ([\d.]+) \(predicting 0: ([\d.]+)\); stage compression from step (\d+); "
                      r"([\d.]+)x fewer bytes than DDP fp32", line)
    assert found, line
    loss, baseline, first_compressed, fewer = (float(v) for v in found.groups())
    assert loss < 0.1 * baseline, line  # it learned the map
    assert 1 < first_compressed <= 151, line  # freeze_step="auto" ends the warmup by half of the 300 steps
    assert fewer > 2, line
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stderr + proc.stdout  # 2 processes
