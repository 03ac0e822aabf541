"""Capture, inside a rank, what the library and Lightning say: log messages and warnings (used by the callback and
strategy tests' scenarios, which run in spawned ranks and return what they captured), and read back what a CSVLogger
wrote."""

from __future__ import annotations

import csv
import logging
import warnings
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def capture_logs() -> Iterator[list[str]]:
    """Messages logged during the block (the library's own logger at INFO, Lightning's rank-zero info)."""
    messages: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = ListHandler(logging.INFO)
    library = logging.getLogger("lightning_onebit")
    old_level = library.level
    library.setLevel(logging.INFO)
    # Lightning's loggers do not propagate to the root logger
    loggers = [library, logging.getLogger("lightning.pytorch"), logging.getLogger("lightning.fabric")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        library.setLevel(old_level)


@contextmanager
def capture_warnings() -> Iterator[list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
        messages.extend(str(w.message) for w in caught)


def logged_columns(path: str, prefix: str) -> dict[str, list[float]]:
    """The values a CSVLogger's ``metrics.csv`` at ``path`` holds for every metric whose name starts with ``prefix``,
    in the order logged (empty cells skipped)."""
    columns: dict[str, list[float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith(prefix) and value != "":
                    columns.setdefault(key, []).append(float(value))
    return columns
