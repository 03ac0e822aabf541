"""Fixtures shared across the test folders.

The tests are grouped by the library's layers (``kernels/``, ``comm/``, ``optim/``, ``hooks/``, ``strategy/``,
``callbacks/``), plus ``gpu/`` (the GPU suite and the CPU-side CUDA detectors) and ``tools/`` (benchmark scripts, the
example, the README's tables). Shared helpers are plain modules at this level, imported as ``tests.X`` (spawned ranks
import them by module path, so they cannot live here): ``distributed`` (gloo ranks), ``*_models`` (small models and
data), ``reference`` (reference oracles), ``tensors`` (seeds, inputs, bitwise comparisons), ``capture`` (log and
warning capture in a rank), ``detectors`` (host syncs, fake CUDA, collective order and counts), ``paths``.

The markers (``slow``, ``gpu``) are registered in ``pyproject.toml``.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def restore_default_backend():
    """Put back the process-wide default kernel backend (``kernels.set_default_backend``) after the test."""
    from lightning_onebit import kernels  # here, not at the top: the tools/ tests do not import the library

    saved = kernels._default_backend
    yield
    kernels.set_default_backend(saved)
