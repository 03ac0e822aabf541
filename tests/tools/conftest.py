"""What the tools tests share: the repository root on ``sys.path`` (they import ``benchmarks.*``), and the example
script imported as a module."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.paths import EXAMPLE, ROOT

sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def example():
    """``examples/bert_finetune.py``, imported as the module ``bert_finetune``."""
    spec = importlib.util.spec_from_file_location("bert_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
