"""Where things are, for tests that read the repository's files or start its scripts (one place, so that a test moved
to another folder does not have to count ``parent``s)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository root
ASSETS = TESTS / "assets"  # scripts the tests run in a subprocess
EXAMPLE = ROOT / "examples" / "bert_finetune.py"  # the BERT example (tests/tools)
MINIMAL_EXAMPLE = ROOT / "examples" / "minimal.py"  # the minimal example (tests/tools)

# Scripts a test starts get the repository root first on PYTHONPATH, so that they run the source under test (not
# whatever copy pip last installed, e.g. another checkout's editable install): the benchmarks' helper does just that.
from benchmarks.common import script_env  # noqa: E402,F401
