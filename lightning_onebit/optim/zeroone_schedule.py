"""0/1 Adam's schedule arguments: DeepSpeed's defaults, the shares of a run they take when they are left to its
length, and fitting them to it (:func:`fitted_arguments`; :func:`fit_schedule_` sets them). What the arguments decide
step by step (which step updates the variance, which is a local step, which syncs) is
:class:`~lightning_onebit.optim.zeroone_adam.ZeroOneSchedule`'s, beside the step that uses it; it moved there, and
still resolves here, with a ``FutureWarning``, until 0.3."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Optional

from lightning_onebit._checks import check_integer

#: The four schedule arguments, in the order :class:`~lightning_onebit.ZeroOneAdam` takes and checks them.
SCHEDULE_ARGUMENTS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
#: DeepSpeed's defaults, used when the run's length is not known (no Lightning strategy).
DEEPSPEED_VAR_FREEZE_STEP, DEEPSPEED_VAR_UPDATE_SCALER, DEEPSPEED_LOCAL_STEP_SCALER = 100000, 16, 32678
#: Without ``var_update_scaler``: the share of the run that starts with full-precision (variance) steps only. The
#: 1-bit steps that follow need a momentum and variance past the first fall of the loss: on the example from scratch
#: DeepSpeed's 16 steps (2.6% of the run) ended 4.8 points under AdamW; a tenth of the run, with local_step_clipper 4,
#: within 0.4 point of it on two seeds.
VAR_WARMUP_SHARE = 0.1
#: Without ``var_freeze_step``: the share of the run whose steps may update the variance, as ``freeze_step="auto"``'s
#: bound (on the example from scratch, a quarter of the run froze the variance mid-transition and ended at chance;
#: half reached 94.9%, docs/benchmarks.md). The variance steps are sparse by then, so a late freeze costs few bytes.
VAR_FREEZE_SHARE = 0.5
#: Without ``local_step_scaler``: how far into the local steps ``local_step_interval`` reaches ``local_step_clipper``.
LOCAL_RAMP_SHARE = 0.25


def schedule_arguments(var_freeze_step: Optional[int], var_update_scaler: Optional[int],
                       local_step_scaler: Optional[int], local_step_clipper: int) -> tuple[dict[str, int], set[str]]:
    """The four schedule arguments as :class:`~lightning_onebit.ZeroOneAdam` was given them, checked (integers
    ``>= 1``; ``ValueError`` naming the argument otherwise), with DeepSpeed's defaults for those given as ``None``,
    and the names of those, which :func:`fitted_arguments` scales to the run's length."""
    given = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                 local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)
    defaults = dict(var_freeze_step=DEEPSPEED_VAR_FREEZE_STEP, var_update_scaler=DEEPSPEED_VAR_UPDATE_SCALER,
                    local_step_scaler=DEEPSPEED_LOCAL_STEP_SCALER)
    arguments = {name: check_integer(defaults[name] if value is None else value, name) for name, value in given.items()}
    return arguments, {name for name, value in given.items() if value is None}


def fitted_arguments(arguments: dict[str, int], from_run: set[str],
                     total_steps: Optional[int]) -> Optional[tuple[dict[str, int], str]]:
    """``arguments`` with those named in ``from_run`` scaled to a run of ``total_steps`` optimizer steps, and what
    was set, for the log (:meth:`ZeroOneAdam.fit_schedule_to_run <lightning_onebit.ZeroOneAdam.fit_schedule_to_run>`
    says how); ``None`` when ``from_run`` is empty. ``ValueError`` for ``total_steps`` neither ``None`` nor an integer
    ``>= 1``, and for ``None`` (a run of unknown length) unless ``from_run`` is empty."""
    check_integer(total_steps, "ZeroOneAdam.fit_schedule_to_run total_steps", none=True,
                  what="an integer >= 1 (the run's length in optimizer steps)", fix="None when it is unknown")
    if not from_run:
        return None
    if total_steps is None:
        raise ValueError(
            f"ZeroOneAdam scales {', '.join(sorted(from_run))} to the run, but its length is unknown (no "
            "max_steps or max_epochs, or an iterable dataset without max_steps): set max_steps/max_epochs, or "
            "give them"
        )
    fitted = dict(arguments)
    if "var_update_scaler" in from_run:
        fitted["var_update_scaler"] = max(1, round(VAR_WARMUP_SHARE * total_steps))
    if "var_freeze_step" in from_run:
        fitted["var_freeze_step"] = max(fitted["var_update_scaler"], round(VAR_FREEZE_SHARE * total_steps))
    if "local_step_scaler" in from_run:
        doublings = max(1, fitted["local_step_clipper"].bit_length() - 1)  # intervals 1, 2, 4, ... up to the clipper
        local_steps = max(1, total_steps - fitted["var_freeze_step"])
        fitted["local_step_scaler"] = max(1, round(LOCAL_RAMP_SHARE * local_steps / doublings))
    return fitted, (f"var_update_scaler {fitted['var_update_scaler']}, var_freeze_step {fitted['var_freeze_step']}, "
                    f"local_step_scaler {fitted['local_step_scaler']} (scaled to {total_steps} steps)")


def fit_schedule_(schedule: Any, total_steps: Optional[int], steps: int) -> Optional[str]:
    """Scale the arguments of ``schedule`` (a :class:`~lightning_onebit.optim.zeroone_adam.ZeroOneSchedule`) named
    in its ``from_run`` to a run of ``total_steps`` optimizer steps (:func:`fitted_arguments`, which raises as it
    says), in place (the checkpoint's entry holds the schedule), and replay its counters to their state after
    ``steps`` steps. Returns what was set, for the log, or ``None`` (nothing to fit: ``from_run`` is empty)."""
    fitted = fitted_arguments(schedule.arguments(), schedule.from_run, total_steps)
    if fitted is None:
        return None
    for name, value in fitted[0].items():
        setattr(schedule, name, value)
    schedule.replay(steps)
    return fitted[1]


#: Names that moved from this module, and the module each is imported from now. They still resolve here, with a
#: ``FutureWarning``, until 0.3; imported on access.
_MOVED = {"ZeroOneSchedule": "lightning_onebit.optim.zeroone_adam", "SYNC_STATE": "lightning_onebit.optim.checkpoint"}


def __getattr__(name: str) -> Any:
    """A moved name (:data:`_MOVED`), from its new module, with a ``FutureWarning`` that names it (PEP 562)."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {module}.{name}; import it from there. It will be removed here in 0.3.",
                  FutureWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
