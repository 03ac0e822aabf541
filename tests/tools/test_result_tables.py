"""The result tables of the docs and the README are the rendering of the benchmark outputs in results/ (never edited
by hand)."""

from __future__ import annotations

from benchmarks import result_tables


def _pages() -> dict[str, str]:
    return {str(path): path.read_text() for path in result_tables.pages()}


def test_result_tables_match_results():
    current = _pages()
    updated = result_tables.render(current)
    stale = [page for page in current if updated[page] != current[page]]
    assert not stale, f"stale result tables in {stale}: run python -m benchmarks.result_tables"


def test_render_replaces_only_marked_blocks():
    current = _pages()
    (page,) = [page for page, text in current.items() if "<!-- results:bytes -->" in text]
    stale = dict(current, **{page: current[page].replace("| 1/32.0 |", "| 1/99.0 |", 1)})
    assert stale[page] != current[page]
    assert result_tables.render(stale) == current
