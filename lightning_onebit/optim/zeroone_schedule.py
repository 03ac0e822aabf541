"""0/1 Adam's schedules (:class:`ZeroOneSchedule`, a part of :class:`~lightning_onebit.ZeroOneAdam`): which step
updates the variance, which takes a local step and which syncs. They follow from the step and the four schedule
arguments alone, so a resumed run replays them; DeepSpeed's defaults, and the shares of a run they take when they are
left to its length."""

from __future__ import annotations

from typing import Optional

from lightning_onebit._checks import check_integer
from lightning_onebit.optim.phases import StepKind

#: Key of 0/1 Adam's schedule and sync state inside the optimizer state dict's "onebit" entry.
SYNC_STATE = "zeroone"

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


class ZeroOneSchedule:
    """0/1 Adam's schedules: which step updates the variance, which takes a local step and which syncs. They follow
    from the step and the four schedule arguments alone (:meth:`replay`), so a resumed run replays them.

    Variance steps (``t <= var_freeze_step`` and ``t % var_interval == 0``) double ``var_interval`` every
    ``var_update_scaler`` of them; local steps (after ``var_freeze_step``) double ``local_step_interval`` every
    ``local_step_scaler`` of them, up to ``local_step_clipper``; a local step syncs when ``t % local_step_interval ==
    0``. ``from_run``: the arguments given as ``None``, which :meth:`fit_to_run` scales to the run's length."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int,
                 from_run: set[str]) -> None:
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.from_run = from_run
        self.replay(0)

    @property
    def warmup_steps(self) -> int:
        """The steps before any compression (the optimizer's ``freeze_step``): the first ``var_update_scaler`` steps
        are all variance steps."""
        return min(self.var_update_scaler, self.var_freeze_step)

    def replay(self, steps: int) -> None:
        """Set the schedules to their state after ``steps`` steps."""
        self.var_interval, self.var_counter, self.variance_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        for t in range(1, steps + 1):
            self.advance(t)

    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` (the next one is ``step_count + 1``) updates the variance with averaged gradients,
        given the current ``var_interval`` (exact for the next step)."""
        return t <= self.var_freeze_step and t % self.var_interval == 0

    def kind(self, t: int) -> StepKind:
        """What step ``t`` (the next one) does: ``VARIANCE``, ``COMPRESSED``, then ``LOCAL`` or ``SYNC``."""
        if t > self.var_freeze_step:
            return StepKind.SYNC if t % self.local_step_interval == 0 else StepKind.LOCAL
        return StepKind.VARIANCE if self.is_variance_step(t) else StepKind.COMPRESSED

    def advance(self, t: int) -> None:
        """The schedule counters after step ``t``."""
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.variance_updates += 1
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)

    def fit_to_run(self, total_steps: Optional[int], step: int) -> Optional[str]:
        """:meth:`ZeroOneAdam.fit_schedule_to_run`, at optimizer step ``step`` (the schedules are replayed to it)."""
        check_integer(total_steps, "ZeroOneAdam.fit_schedule_to_run total_steps", none=True,
                      what="an integer >= 1 (the run's length in optimizer steps)", fix="None when it is unknown")
        if not self.from_run:
            return None
        if total_steps is None:
            raise ValueError(
                f"ZeroOneAdam scales {', '.join(sorted(self.from_run))} to the run, but its length is unknown (no "
                "max_steps or max_epochs, or an iterable dataset without max_steps): set max_steps/max_epochs, or "
                "give them"
            )
        if "var_update_scaler" in self.from_run:
            self.var_update_scaler = max(1, round(VAR_WARMUP_SHARE * total_steps))
        if "var_freeze_step" in self.from_run:
            self.var_freeze_step = max(self.var_update_scaler, round(VAR_FREEZE_SHARE * total_steps))
        if "local_step_scaler" in self.from_run:
            doublings = max(1, self.local_step_clipper.bit_length() - 1)  # intervals 1, 2, 4, ... up to the clipper
            local_steps = max(1, total_steps - self.var_freeze_step)
            self.local_step_scaler = max(1, round(LOCAL_RAMP_SHARE * local_steps / doublings))
        self.replay(step)
        return (f"var_update_scaler {self.var_update_scaler}, var_freeze_step {self.var_freeze_step}, "
                f"local_step_scaler {self.local_step_scaler} (scaled to {total_steps} steps)")

    def arguments(self) -> dict[str, int]:
        """The four schedule arguments (what a checkpoint records)."""
        return dict(var_freeze_step=self.var_freeze_step, var_update_scaler=self.var_update_scaler,
                    local_step_scaler=self.local_step_scaler, local_step_clipper=self.local_step_clipper)
