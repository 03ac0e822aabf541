"""Every documentation pointer in a runtime message names a page under docs/ that exists, and a heading of it that
exists when it names an anchor (the messages leave their explanation to that page: a broken pointer leaves the user
with nothing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Optional

import pytest

from lightning_onebit._docs import docs_page, docs_pointer
from tests.paths import ROOT

LIBRARY = ROOT / "lightning_onebit"
DOCS = ROOT / "docs"
HELPERS = ("docs_pointer", "docs_page")


def _slug(title: str) -> str:
    """GitHub/MyST heading slug (``myst_parser.slugs.github_slugify``) of a heading's rendered text: lowercase,
    spaces to '-', everything but word characters, '-' and spaces dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link shows its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower().replace(" ", "-"))


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page (levels 1-4, as ``myst_heading_anchors = 4`` in docs/conf.py), with
    ``-1``, ``-2`` ... for repeated titles; lines inside fenced code blocks are not headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fence: Optional[str] = None
    for line in page.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0]
            elif stripped.startswith(fence * 3):
                fence = None
            continue
        heading = re.match(r"#{1,4} +(.*?) *#* *$", line) if fence is None else None
        if heading:
            slug = _slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _pointers() -> list[tuple[str, Optional[str], Optional[str]]]:
    """``(where, page, anchor)`` of every ``docs_pointer``/``docs_page`` call in the library; ``page`` is ``None``
    where the arguments are not string literals (which this test cannot check, so they must be)."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "_docs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in HELPERS:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            args = list(node.args) + [k.value for k in node.keywords]
            literal = all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args)
            if not (1 <= len(args) <= 2 and literal):
                found.append((where, None, None))
                continue
            values = [a.value for a in args]
            found.append((where, values[0], values[1] if len(values) > 1 else None))
    return found


POINTERS = _pointers()


def test_the_library_points_to_the_docs() -> None:
    # the messages this test guards: if the scan found none, it is looking in the wrong place
    assert len(POINTERS) >= 10, POINTERS


@pytest.mark.parametrize(
    "where, page, anchor", POINTERS, ids=[f"{w.split(':')[0]}-{p}" + (f"#{a}" if a else "") for w, p, a in POINTERS]
)
def test_every_pointer_names_an_existing_page_and_heading(where: str, page: Optional[str], anchor: Optional[str]):
    assert page is not None, f"{where}: docs_pointer() takes a literal page and an optional literal anchor"
    assert not page.endswith(".md") and not page.startswith(("/", "docs/")), f"{where}: {page!r}: a path under docs/"
    target = DOCS / f"{page}.md"
    assert target.is_file(), f"{where}: {docs_page(page)} does not exist"
    if anchor is not None:
        anchors = _anchors(target)
        assert anchor in anchors, f"{where}: {docs_page(page, anchor)}: no such heading; it has {sorted(anchors)}"


def test_no_message_spells_a_docs_path_by_hand() -> None:
    """Only the helper makes pointers (one place to change when the docs get a site); docstrings may name pages."""
    spelled = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "_docs.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(owner.body[0].value)
            for owner in ast.walk(tree)
            if isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and owner.body and isinstance(owner.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if re.search(r"docs/\S+\.md", node.value):
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert spelled == []


def test_the_pointer_form() -> None:
    assert docs_pointer("guides/checkpoints") == "see docs/guides/checkpoints.md"
    assert docs_pointer("guides/freeze-step", "embedding-tables") == "see docs/guides/freeze-step.md#embedding-tables"


def test_the_slugs_follow_github() -> None:
    assert _slug("Choosing `freeze_step`") == "choosing-freeze_step"
    assert _slug("What `auto` decided on real fine-tuning and from scratch") == (
        "what-auto-decided-on-real-fine-tuning-and-from-scratch"
    )
    assert _slug("Will compression help on your network?") == "will-compression-help-on-your-network"
    assert {"configuration", "configuration-1"} <= _anchors(DOCS / "guides" / "configuration.md")
    freeze_step = _anchors(DOCS / "guides" / "freeze-step.md")
    assert "embedding-tables" in freeze_step and "embedding" not in freeze_step
    assert not any(a.startswith("torchrun") for a in _anchors(DOCS / "guides" / "multi-node.md"))  # a code comment


def test_every_benchmark_command_in_the_docs_names_a_module_that_exists():
    """``python -m benchmarks.NAME`` in the README, CONTRIBUTING and the docs pages runs a module of ``benchmarks/``
    (CONTRIBUTING named ``benchmarks.readme_results``, which had become ``benchmarks.result_tables``)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]
    named = {(page.relative_to(ROOT).as_posix(), name) for page in pages
             for name in re.findall(r"python -m benchmarks\.([A-Za-z_][A-Za-z0-9_]*)", page.read_text(encoding="utf-8"))}
    assert named, "no benchmark command found: the pattern is wrong"
    missing = sorted((page, name) for page, name in named
                     if name != "NAME" and not (ROOT / "benchmarks" / f"{name}.py").is_file())
    assert not missing, f"commands naming no module of benchmarks/: {missing}"
