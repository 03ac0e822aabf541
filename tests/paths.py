"""Where things are, for tests that read the repository's files or start its scripts (one place, so that a test moved
to another folder does not have to count ``parent``s)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository root
ASSETS = TESTS / "assets"  # scripts the tests run in a subprocess
EXAMPLE = ROOT / "examples" / "bert_finetune.py"  # the BERT example (tests/tools)
MINIMAL_EXAMPLE = ROOT / "examples" / "minimal.py"  # the minimal example (tests/tools)


def script_env(**changes: str) -> dict[str, str]:
    """The environment for a subprocess that imports the library: this process's, with the repository root first on
    ``PYTHONPATH``, so that the script tests the same source as the test that starts it (not whatever copy pip last
    installed, e.g. another checkout's editable install), plus ``changes``."""
    import os

    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}", **changes)
