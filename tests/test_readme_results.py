"""The README's result tables are the rendering of the benchmark outputs in results/ (never edited by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import readme_results  # noqa: E402


def test_readme_tables_match_results():
    current = readme_results.README.read_text()
    assert readme_results.render(current) == current, "stale README tables: run python benchmarks/readme_results.py"


def test_render_replaces_only_marked_blocks():
    text = readme_results.README.read_text()
    stale = text.replace("| 1/32.0 |", "| 1/99.0 |", 1)
    assert stale != text
    assert readme_results.render(stale) == text
