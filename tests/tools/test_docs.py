"""The documentation site builds with warnings as errors (broken links, bad docstrings, missing pages fail here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT, script_env


def test_docs_build_without_warnings(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         str(ROOT / "docs"), str(tmp_path / "html")],
        env=script_env(), capture_output=True, text=True, timeout=600,
    )
    # (without the docs extra: "No module named sphinx"; pip install -e ".[docs]")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    index = (tmp_path / "html" / "index.html").read_text()
    assert "Is it for me?" in index
    api = (tmp_path / "html" / "api.html").read_text()
    # the reference is made from the docstrings: OnebitAdam's arguments are there
    assert "freeze_step" in api and "OnebitStrategy" in api
