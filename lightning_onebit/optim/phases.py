"""What an optimizer step does and in which phase of training it runs: the one vocabulary shared by the optimizers,
the hooks, the strategy and the callbacks, and the sentences the strategy logs when a phase begins.

Each compressed optimizer says what its next step will do (:attr:`CompressedOptimizer.next_step_kind
<lightning_onebit.optim.base.CompressedOptimizer.next_step_kind>`), which is what the DDP comm hook asks before every
backward (:attr:`StepKind.averages_gradients`), and records what every step did (``steps_by_kind``,
``last_step_kind``). Its phases (what the strategy announces, ``describe_phase``) are named by the kind of step that
characterises them (:func:`phase_sentence` for 1-bit Adam and 1-bit LAMB, :func:`zeroone_phase_sentence` for 0/1
Adam).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim.auto_freeze import FreezeDetector


class OnebitStage(str, enum.Enum):
    """The stage an optimizer step runs in."""

    WARMUP = "warmup"
    COMPRESSION = "compression"


class StepKind(enum.StrEnum):
    """The kind of an optimizer step. A ``str`` (``StepKind.WARMUP == "warmup"``), so it logs and compares as text."""

    #: Gradients averaged in full precision by DDP, the full-precision update (the warmup of 1-bit Adam and LAMB).
    WARMUP = "warmup"
    #: One 1-bit compressed exchange of the momenta (or 0/1 Adam's gradients), the variance frozen.
    COMPRESSED = "compressed"
    #: 0/1 Adam: gradients averaged in full precision by DDP; momentum and variance updated (its warmup steps too).
    VARIANCE = "variance"
    #: 0/1 Adam: a step on this rank's own gradient, with no communication.
    LOCAL = "local"
    #: 0/1 Adam: a local step, then the update accumulated since the last sync averaged by a 1-bit exchange.
    SYNC = "sync"

    @property
    def averages_gradients(self) -> bool:
        """Whether the backward before a step of this kind must average gradients across ranks (DDP's allreduce)."""
        return self in (StepKind.WARMUP, StepKind.VARIANCE)


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
        return StepKind.WARMUP, (
            f"warmup (gradients averaged in full precision, full-precision {name} update) until {until}; {_DOCS}"
        )
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


#: The page with 0/1 Adam's schedules (what its phase announcements summarise).
_ZEROONE_DOCS = docs_pointer("guides/configuration")


def zeroone_phase_sentence(step: int, schedule: Any, exchange: str, uncompressed: bool) -> tuple[StepKind, str]:
    """``(phase, sentence)`` for 0/1 Adam's next step after ``step`` steps, by its ``schedule`` (a
    :class:`~lightning_onebit.optim.zeroone_adam.ZeroOneSchedule`): its warmup (every step a variance step), then
    variance steps every ``var_interval`` steps with 1-bit exchanges of ``exchange`` (``"momentum"`` or
    ``"gradient"``) in between until ``var_freeze_step``, then local steps synced every ``local_step_interval`` steps
    (``uncompressed``: some param groups have ``compress=False``)."""
    freeze_step, var_freeze_step = schedule.warmup_steps, schedule.var_freeze_step
    t = step + 1
    if t <= freeze_step:
        return StepKind.WARMUP, (
            f"warmup until optimizer step {freeze_step}: every step a variance step (gradients averaged in full "
            f"precision, full-precision Adam update); {_ZEROONE_DOCS}"
        )
    if t <= var_freeze_step:
        averaged = "momenta" if exchange == "momentum" else "gradients"
        return StepKind.VARIANCE, (
            f"from optimizer step {freeze_step + 1}{resumed_at(step, freeze_step)}: a variance step (DDP allreduce) "
            f"every {schedule.var_interval} steps, the interval doubling every {schedule.var_update_scaler} of them, "
            f"until step {var_freeze_step}; {averaged} averaged in 1 bit in between; {_ZEROONE_DOCS}"
        )
    groups = " (compress=False groups: full precision every step)" if uncompressed else ""
    return StepKind.LOCAL, (
        f"from optimizer step {var_freeze_step + 1}{resumed_at(step, var_freeze_step)}: variance frozen; local steps "
        f"without communication{groups}, the accumulated update averaged in 1 bit every "
        f"{schedule.local_step_interval} steps (doubling every {schedule.local_step_scaler} steps up to "
        f"{schedule.local_step_clipper}); {_ZEROONE_DOCS}"
    )
