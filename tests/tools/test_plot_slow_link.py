"""benchmarks/plot_slow_link.py re-plots results/slow_link.json (it runs nothing) into a picture readable at the 830 px
the docs show it at."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("matplotlib")  # the benchmarks extra

from benchmarks import plot_slow_link  # noqa: E402
from tests.paths import ROOT  # noqa: E402


def test_slow_link_picture_from_the_results_is_830_px_wide(tmp_path, monkeypatch):
    import matplotlib.image

    output = tmp_path / "slow_link.png"
    monkeypatch.setattr(sys, "argv", ["plot_slow_link", "--input", str(ROOT / "results" / "slow_link.json"),
                                      "--output", str(output)])
    plot_slow_link.main()
    image = matplotlib.image.imread(output)
    assert image.shape[1] == 830


def test_derived_run_is_warmup_then_steady():
    steps, values = plot_slow_link._cumulative(10.0, 1.0, total=5, warmup=2)
    assert steps == [0, 1, 2, 3, 4, 5] and values == [0, 10, 20, 21, 22, 23]
    rows = json.loads((ROOT / "results" / "slow_link.json").read_text())["rates"]["1gbit"]["rows"]
    step_s, bytes_per_step = plot_slow_link._stage(rows, "ddp_powersgd:warmup")
    assert bytes_per_step == rows["ddp_powersgd"]["warmup_bytes_per_step"]
