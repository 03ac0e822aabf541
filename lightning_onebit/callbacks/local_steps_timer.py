"""LocalStepsTimer: the wall time of ``onebit_diloco``'s optimizer steps, split into steps with and without an outer
sync, and from them the :class:`~lightning_onebit.callbacks.advice.LocalStepsAdvice` of ``CommunicationMonitor``."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Optional, Union

import torch

from lightning_onebit.callbacks.advice import LOCAL_STEPS_DOCS, LocalStepsAdvice
from lightning_onebit.comm.agreement import agree
from lightning_onebit.strategy import OnebitDiLoCoFSDPStrategy, OnebitDiLoCoStrategy

#: timed steps with an outer sync the advice needs at least (the first sync of a fit, which lays its buffers out, is
#: never timed)
MIN_SYNCS_TIMED = 2


class LocalStepsTimer:
    """Times one ``fit``'s optimizer steps under ``onebit_diloco`` or ``onebit_diloco_fsdp`` (wall time between the
    ends of consecutive optimizer steps, as for ``onebit_adam``'s warmup): a step is a *sync step* when the strategy's
    ``outer_syncs`` grew in it.

    Not timed: the first ``settling_steps`` steps of the fit (buckets built, allocators warmed up), the fit's first
    sync step (the outer exchange lays its buffers out), and the step after a validation loop (which ran in between).
    Every rank times the same steps (steps, syncs and validations are rank-identical), so every rank is
    :attr:`ready` at the same step and may then call :meth:`advice`, a collective.

    Args:
        advise_steps: steps without a sync in the median (the last ones), and the least timed before advising.
        settling_steps: steps at the start of the fit that are not timed.
    """

    def __init__(self, strategy: Union[OnebitDiLoCoStrategy, OnebitDiLoCoFSDPStrategy], advise_steps: int,
                 settling_steps: int) -> None:
        self.strategy = strategy
        self.advise_steps = advise_steps
        self.settling_steps = settling_steps
        self.plain: collections.deque[float] = collections.deque(maxlen=advise_steps)  # seconds
        self.syncs: list[float] = []  # seconds
        self.plain_timed = 0  # steps without a sync timed in this fit (``plain`` keeps the last ones)
        self.steps = 0  # optimizer steps of this fit
        self.syncs_seen = 0  # sync steps of this fit, timed or not
        self._last_time: Optional[float] = None
        self._last_syncs = strategy.outer_syncs

    def pause(self) -> None:
        """Do not time the next step (something that is not training, e.g. a validation loop, runs before it)."""
        self._last_time = None

    def record(self) -> None:
        """Called at the end of every optimizer step of the fit."""
        now = time.perf_counter()
        step_s = None if self._last_time is None else now - self._last_time
        self._last_time = now
        self.steps += 1
        synced = self.strategy.outer_syncs > self._last_syncs
        self._last_syncs = self.strategy.outer_syncs
        self.syncs_seen += synced
        if step_s is None or self.steps <= self.settling_steps:
            return
        if not synced:
            self.plain.append(step_s)
            self.plain_timed += 1
        elif self.syncs_seen > 1:
            self.syncs.append(step_s)

    @property
    def ready(self) -> bool:
        """Whether enough steps of both kinds were timed to advise (the same answer on every rank)."""
        return len(self.plain) >= self.advise_steps and len(self.syncs) >= MIN_SYNCS_TIMED

    def advice(self) -> LocalStepsAdvice:
        """The advice from every rank's medians (a collective over WORLD: one small ``all_reduce``). The floor is the
        slowest rank's; a sync's cost is the least any rank saw, the rank that reached the sync last: the others
        also waited there for its inner steps, which is not the sync's cost."""
        floor = statistics.median(self.plain)
        extra = max(0.0, statistics.median(self.syncs) - floor)
        sent = self.strategy.last_sync_communication.bytes_sent_inter_node
        figures = torch.tensor([floor, -extra, float(sent)], dtype=torch.float64, device=self.strategy.root_device)
        inner_step_s, minus_sync_s, bytes_per_sync = agree(figures, None, reduce="max").tolist()
        return LocalStepsAdvice(inner_step_s=inner_step_s, sync_s=-minus_sync_s, sync_every=self.strategy.sync_every,
                                bytes_per_sync=bytes_per_sync, steps_timed=len(self.plain),
                                syncs_timed=len(self.syncs))

    def why_no_advice(self) -> str:
        """Why this fit got no advice (at its end, not :attr:`ready`)."""
        if self.strategy.sync_every == 1:
            return ("every step ran an outer sync (sync_every=1), so no step measured the no-communication floor to "
                    f"compare with; {LOCAL_STEPS_DOCS}")
        return (
            f"this fit timed {self.plain_timed} step(s) without an outer sync and {len(self.syncs)} with one, and the "
            f"advice needs {self.advise_steps} (CommunicationMonitor(advise_steps=...)) and {MIN_SYNCS_TIMED}: the "
            f"first {self.settling_steps} steps and the first sync of a fit are not timed, so with "
            f"sync_every={self.strategy.sync_every} it needs at least "
            f"{(MIN_SYNCS_TIMED + 1) * self.strategy.sync_every} steps; {LOCAL_STEPS_DOCS}"
        )
