"""The README's result tables are the rendering of the benchmark outputs in results/ (never edited by hand)."""

from __future__ import annotations

from benchmarks import readme_results


def test_readme_tables_match_results():
    current = readme_results.README.read_text()
    assert readme_results.render(current) == current, "stale README tables: run python -m benchmarks.readme_results"


def test_render_replaces_only_marked_blocks():
    text = readme_results.README.read_text()
    stale = text.replace("| 1/32.0 |", "| 1/99.0 |", 1)
    assert stale != text
    assert readme_results.render(stale) == text
