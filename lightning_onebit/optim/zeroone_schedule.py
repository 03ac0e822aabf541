"""0/1 Adam's schedules, as a mixin of :class:`~lightning_onebit.ZeroOneAdam`: which step updates the variance, which
takes a local step and which syncs. They follow from the step and the four schedule arguments alone, so a resumed run
replays them; the checkpoint entry that goes with them holds the sums since the last sync.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

from lightning_onebit._checks import check_integer
from lightning_onebit.optim.step_kind import StepKind

log = logging.getLogger(__name__)

_SYNC_STATE = "zeroone"  # key of the schedule and sync state inside the optimizer state dict's "onebit" entry

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


class ZeroOneScheduleMixin:
    """The schedules and the checkpoint state of :class:`~lightning_onebit.ZeroOneAdam`, which sets the attributes
    below."""

    var_freeze_step: int
    freeze_step: Optional[int]
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    param_groups: list[dict[str, Any]]
    _step: int
    _zero_variance: dict[int, torch.Tensor]

    _schedule_from_run: set[str]

    # ------------------------------------------------------------------ schedules
    def fit_schedule_to_run(self, total_steps: Optional[int]) -> Optional[str]:
        """Scale the schedule arguments given as ``None`` to a run of ``total_steps`` optimizer steps (the Lightning
        strategies call this at the start of ``fit`` with the Trainer's estimate): ``var_update_scaler`` a tenth of
        the run (the steps that are all variance steps), ``var_freeze_step`` half the run (at least
        ``var_update_scaler``), ``local_step_scaler`` such that ``local_step_interval`` reaches
        ``local_step_clipper`` a quarter of the way into the remaining steps. Returns what was set, for the log
        (``None``: every argument was given). ``total_steps=None`` (a run of unknown length) raises ``ValueError``
        naming the arguments to give, unless every one was given; so does anything but ``None`` or an integer
        ``>= 1`` (a bool, a float, a string)."""
        check_integer(total_steps, "ZeroOneAdam.fit_schedule_to_run total_steps", none=True,
                      what="an integer >= 1 (the run's length in optimizer steps)", fix="None when it is unknown")
        if not self._schedule_from_run:
            return None
        if total_steps is None:
            raise ValueError(
                f"ZeroOneAdam scales {', '.join(sorted(self._schedule_from_run))} to the run, but its length is "
                "unknown (no max_steps or max_epochs, or an iterable dataset without max_steps): set "
                "max_steps/max_epochs, or give them"
            )
        if "var_update_scaler" in self._schedule_from_run:
            self.var_update_scaler = max(1, round(VAR_WARMUP_SHARE * total_steps))
        if "var_freeze_step" in self._schedule_from_run:
            self.var_freeze_step = max(self.var_update_scaler, round(VAR_FREEZE_SHARE * total_steps))
        self.freeze_step = min(self.var_update_scaler, self.var_freeze_step)  # the steps before any compression
        if "local_step_scaler" in self._schedule_from_run:
            doublings = max(1, self.local_step_clipper.bit_length() - 1)  # intervals 1, 2, 4, ... up to the clipper
            local_steps = max(1, total_steps - self.var_freeze_step)
            self.local_step_scaler = max(1, round(LOCAL_RAMP_SHARE * local_steps / doublings))
        sums = self._lr_sum, self._decay, self.local_steps_since_sync
        self._replay_schedules(self._step)
        self._lr_sum, self._decay, self.local_steps_since_sync = sums
        return (f"var_update_scaler {self.var_update_scaler}, var_freeze_step {self.var_freeze_step}, "
                f"local_step_scaler {self.local_step_scaler} (scaled to {total_steps} steps)")

    def _replay_schedules(self, steps: int) -> None:
        """Set the schedules to their state after ``steps`` steps. They depend only on the step and the four
        schedule arguments, so a resumed run recomputes them instead of trusting (or resetting) saved counters."""
        self.var_interval, self._var_counter, self.variance_updates = 1, 0, 0
        self.local_step_interval, self._local_step_counter = 1, 0
        for t in range(1, steps + 1):
            self._advance_schedules(t)
        # the local-step phase's sums since the last sync: None until it begins (or after a load that lacks them)
        self._lr_sum: Optional[list[float]] = None
        self._decay: Optional[list[float]] = None
        self.local_steps_since_sync = 0

    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` (the next one is ``step_count + 1``) updates the variance with averaged gradients,
        given the current ``var_interval`` (exact for the next step)."""
        return t <= self.var_freeze_step and t % self.var_interval == 0

    def _advance_schedules(self, t: int) -> None:
        """The schedule counters after step ``t``: variance steps double ``var_interval`` every
        ``var_update_scaler`` of them; local steps double ``local_step_interval`` every ``local_step_scaler`` of
        them, up to ``local_step_clipper``."""
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.variance_updates += 1
                self._var_counter += 1
                if self._var_counter == self.var_update_scaler:
                    self._var_counter = 0
                    self.var_interval *= 2
        else:
            self._local_step_counter += 1
            if self._local_step_counter == self.local_step_scaler:
                self._local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)

    @property
    def next_step_kind(self) -> StepKind:
        """``VARIANCE`` (the warmup's steps and every ``var_interval``-th step up to ``var_freeze_step``: gradients
        averaged in full precision), ``COMPRESSED`` (the other steps until then), then ``LOCAL``, or ``SYNC`` every
        ``local_step_interval``-th step. Exact: the schedules depend only on the step."""
        t = self._step + 1
        if t > self.var_freeze_step:
            return StepKind.SYNC if t % self.local_step_interval == 0 else StepKind.LOCAL
        return StepKind.VARIANCE if self.is_variance_step(t) else StepKind.COMPRESSED

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """As :meth:`CompressedOptimizer.state_dict`, plus the sums since the last sync. Between syncs (after a
        local step) it holds this rank's own replica state and warns: call :meth:`synchronize` on every rank first
        for a checkpoint that resumes exactly (the Lightning strategy does)."""
        if self.local_steps_since_sync:
            warnings.warn(
                f"ZeroOneAdam.state_dict() after {self.local_steps_since_sync} local step(s) since the last sync: "
                "this rank's replica differs from the others'; call synchronize() on every rank before saving for "
                "an exact resume",
                UserWarning,
                stacklevel=2,
            )
        state_dict = super().state_dict()
        state_dict["onebit"][_SYNC_STATE] = {
            "lr_sum": self._lr_sum,
            "decay": self._decay,
            "local_steps_since_sync": self.local_steps_since_sync,
            # the schedules themselves follow from the step and these (load_state_dict replays them)
            "schedule_arguments": self._schedule_arguments(),
        }
        return state_dict

    def _schedule_arguments(self) -> dict[str, int]:
        return {
            "var_freeze_step": self.var_freeze_step,
            "var_update_scaler": self.var_update_scaler,
            "local_step_scaler": self.local_step_scaler,
            "local_step_clipper": self.local_step_clipper,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`CompressedOptimizer.load_state_dict`; the schedules are recomputed from the loaded step with
        this optimizer's schedule arguments (logged if the checkpoint was saved with others), the sums since the last
        sync are restored."""
        saved = (state_dict.get("onebit") or {}).get(_SYNC_STATE)
        super().load_state_dict(state_dict)
        self._replay_schedules(self._step)
        self._zero_variance = {}
        if saved is None:
            return  # e.g. an AdamW or OnebitAdam state dict: local steps (if any) start from the loaded point
        if saved.get("schedule_arguments") not in (None, self._schedule_arguments()):
            log.info(
                "ZeroOneAdam: the checkpoint was saved with schedule arguments %s; continuing from step %d with "
                "those of the code, %s",
                saved["schedule_arguments"],
                self._step,
                self._schedule_arguments(),
            )
        if saved.get("lr_sum") is not None and len(saved["lr_sum"]) == len(self.param_groups):
            self._lr_sum = [float(x) for x in saved["lr_sum"]]
            self._decay = [float(x) for x in saved["decay"]]
            self.local_steps_since_sync = int(saved.get("local_steps_since_sync", 0))
