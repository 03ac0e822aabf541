"""The sentence the strategy logs when a 1-bit Adam or 1-bit LAMB run enters a phase (warmup, then the compression
stage); :class:`~lightning_onebit.ZeroOneAdam` describes its own phases."""

from __future__ import annotations

from typing import Callable, Optional

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim.auto_freeze import FreezeDetector
from lightning_onebit.optim.step_kind import StepKind

#: The page that explains the warmup, the freeze and what ``freeze_step='auto'`` measures.
_DOCS = docs_pointer("guides/freeze-step")


def phase_sentence(
    name: str,
    warmup: bool,
    step: int,
    freeze_step: Optional[int],
    detector: Optional[FreezeDetector],
    rule: Callable[[], str],
    uncompressed: bool,
) -> tuple[StepKind, str]:
    """``(phase, sentence)`` for the next step of the optimizer class ``name`` after ``step`` steps: in ``warmup``
    until ``freeze_step`` (``None``: ``freeze_step="auto"`` still measuring, by ``rule()``, its detector's rule), else
    in the compression stage, which began at step ``freeze_step + 1`` (``detector``: the one that decided the freeze
    step, if any; ``uncompressed``: whether some param groups have ``compress=False``). A run resumed inside the
    compression stage says where it continues it."""
    if warmup:
        until = (
            f"optimizer step {freeze_step}"
            if freeze_step is not None
            else "the variance settles (freeze_step='auto': " + rule() + ")"
        )
        return StepKind.WARMUP, f"warmup (gradients averaged in full precision, full-precision {name} update) until {until}; {_DOCS}"
    assert freeze_step is not None  # the compression stage follows a known freeze step
    decided = "" if detector is None else f" (freeze_step='auto' decided {freeze_step}: " + detector.describe() + ")"
    groups = "; compress=False groups averaged in full precision"
    return StepKind.COMPRESSED, (
        f"compression stage from optimizer step {freeze_step + 1}{resumed_at(step, freeze_step)}: momenta averaged "
        f"in 1 bit, variance frozen{decided}{groups if uncompressed else ''}; {_DOCS}"
    )


def resumed_at(step: int, last_step_before: int) -> str:
    """``" (this run continues it from step N)"`` when the next step, ``step + 1``, is not the first of a phase that
    began after step ``last_step_before`` (a resumed run), else ``""``: a phase is named by the step it began at."""
    return f" (this run continues it from step {step + 1})" if step > last_step_before else ""
