"""The warmup against the run's length, at the start of every ``fit``: ``freeze_step="auto"`` without
``AutoFreeze(max_step=...)`` bounded by half the run, schedules left to the run scaled to it (ZeroOneAdam's), and a
warning when the warmup cannot end before the run does.
(The rule of ``freeze_step="auto"`` itself is :mod:`lightning_onebit.optim.auto_freeze`.)"""

from __future__ import annotations

from typing import Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.auto_freeze_config import DEFAULT_BOUND_SHARE

RunLength = Callable[["pl.Trainer"], Optional[int]]

#: The page on the warmup's length (``freeze_step``, ``AutoFreeze``'s bound).
_DOCS = docs_pointer("guides/freeze-step")


def run_length(trainer: "pl.Trainer") -> Optional[int]:
    """The run's optimizer steps, or ``None`` when unknown: no max_steps or max_epochs (infinite), or an
    iterable dataset without max_steps (Lightning then estimates -1)."""
    total = trainer.estimated_stepping_batches
    return int(total) if isinstance(total, (int, float)) and 0 < total < float("inf") else None


def default_auto_freeze_bound(
    trainer: "pl.Trainer", optimizer: CompressedOptimizer, length: RunLength = run_length, name: str = "onebit_adam"
) -> None:
    """freeze_step='auto' without ``AutoFreeze(max_step=...)``: end the warmup by half the run at the latest
    (``length``: the run's length, asked only then), said on rank 0 by the strategy ``name``."""
    detector = optimizer.freeze_detector
    if detector is None or detector.max_step is not None:
        return
    total = length(trainer)
    if total is None:
        raise ValueError(
            f"{type(optimizer).__name__}(freeze_step='auto') bounds the warmup by {DEFAULT_BOUND_SHARE:.0%} of the "
            "run, but the Trainer's "
            "length is unknown (no max_steps or max_epochs, or an iterable dataset without max_steps): set "
            "max_steps/max_epochs, or AutoFreeze(max_step=...)"
        )
    bound = detector.bound_by_run(total)
    rank_zero_info(
        f"{name}: freeze_step='auto' ends the warmup at step {bound} at the latest "
        f"({DEFAULT_BOUND_SHARE:.0%} of {total} steps)"
    )


def fit_schedule_to_run(
    trainer: "pl.Trainer", optimizer: CompressedOptimizer, name: str, length: RunLength = run_length
) -> None:
    """Schedule arguments the optimizer left to the run's length (ZeroOneAdam's ``var_freeze_step`` and
    ``local_step_scaler`` given as ``None``) scaled to it, and said on rank 0 by the strategy ``name``. The optimizer
    raises ``ValueError`` if it needs the length and the Trainer's is unknown."""
    scaled = optimizer.fit_schedule_to_run(length(trainer))
    if scaled is not None:
        rank_zero_info(f"{name}: {type(optimizer).__name__} {scaled}")


def warn_if_run_ends_in_warmup(
    trainer: "pl.Trainer", optimizer: CompressedOptimizer, length: RunLength = run_length, name: str = "onebit_adam"
) -> None:
    """Warn when the warmup cannot end before the run does (a fixed ``freeze_step``: the whole run is plain DDP)
    or is only bounded past its end (``freeze_step='auto'``: plain DDP unless the detector decides earlier), in the
    name of the strategy ``name``."""
    detector = optimizer.freeze_detector
    last_warmup = optimizer.freeze_step if detector is None else detector.max_step
    total = length(trainer)
    if last_warmup is None or total is None or last_warmup < total:
        return
    if detector is not None:
        # the detector may still end the warmup before its bound: only the worst case is known at fit start
        rank_zero_warn(
            f"{name}: freeze_step='auto' with AutoFreeze(max_step={last_warmup}), but the run has {total} "
            "optimizer steps: compression starts only if the detector ends the warmup earlier (else compression "
            f"never starts). Lower max_step, or train longer; {_DOCS}"
        )
        return
    rank_zero_warn(
        f"{name}: freeze_step={last_warmup}, but the run has {total} optimizer steps: it ends in the warmup, "
        f"so it is plain DDP and compression never starts. Lower freeze_step, or train longer; {_DOCS}"
    )
