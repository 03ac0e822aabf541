"""The optimizer's side of ``freeze_step="auto"``: the options checked at construction, the freeze-detector part
(:class:`FreezeControl`, which makes and feeds the :class:`~lightning_onebit.optim.auto_freeze.FreezeDetector`) and the
variance readings it takes after each warmup step. The rule that decides the freeze step is
:mod:`~lightning_onebit.optim.auto_freeze`'s.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_integer
from lightning_onebit.optim.auto_freeze import FreezeDetector, VarianceReading
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.buckets import trainable
from lightning_onebit.optim.functional import bias_corrections

log = logging.getLogger(__name__)


def check_freeze_options(
    freeze_step: Union[int, str], auto_freeze: Optional[AutoFreeze], owner: str
) -> Optional[AutoFreeze]:
    """Raise ``ValueError`` unless ``freeze_step`` is an int >= 1 or ``"auto"`` and ``auto_freeze`` is ``None`` or an
    :class:`~lightning_onebit.AutoFreeze`; return the ``auto_freeze`` that applies.

    An integer ``freeze_step`` wins over ``auto_freeze`` settings given with it (a config that ships an ``auto_freeze``
    block, overridden on the command line with ``--optimizer.init_args.freeze_step=60``): they are dropped with a
    warning that says so, and ``None`` is returned."""
    if not (isinstance(freeze_step, str) and freeze_step == "auto"):
        check_integer(freeze_step, "freeze_step",
                      what="an integer >= 1 (the number of warmup steps that estimate the variance) or 'auto'")
    if auto_freeze is not None and not isinstance(auto_freeze, AutoFreeze):
        raise ValueError(f"auto_freeze must be a lightning_onebit.AutoFreeze, got {type(auto_freeze).__name__}")
    if auto_freeze is not None and freeze_step != "auto":
        warnings.warn(
            f"{owner}: freeze_step={freeze_step} is used and the auto_freeze settings given with it are not (they "
            "only apply to freeze_step='auto')",
            UserWarning,
            stacklevel=4,
        )
        return None
    return auto_freeze


class FreezeControl:
    """The freeze-detector part of a compressed optimizer under ``freeze_step="auto"``: its settings (``config``,
    ``None`` with an integer ``freeze_step``), its :class:`~lightning_onebit.optim.auto_freeze.FreezeDetector` (made at
    first use: its default window follows the first param group's ``beta2``) and whether ``step(closure)`` records the
    closure's loss (:attr:`observe_closure_loss`, off where the caller records every loss itself)."""

    def __init__(self, config: Optional[AutoFreeze], owner: str) -> None:
        self.config, self.owner = config, owner
        self.detector: Optional[FreezeDetector] = None
        self.observe_closure_loss = True

    def ensure(self, beta2: float) -> FreezeDetector:
        """The detector, made now if it is not yet."""
        if self.detector is None:
            assert self.config is not None
            self.detector = FreezeDetector(self.config, beta2, self.owner)
        return self.detector

    def after_warmup_step(self, t: int, beta2: float, read: Callable[[], VarianceReading], rank: int) -> Optional[int]:
        """Measure after warmup step ``t`` (``read()`` at check steps only; a collective from the first full window on:
        every rank calls it at the same steps); returns ``t`` when the warmup ends with it, said on rank 0."""
        detector = self.ensure(beta2)
        decided = detector.observe(t, read)
        if decided is not None and rank == 0:
            log.info("%s: freeze_step='auto' decided %d (%s); the compression stage starts at step %d", self.owner,
                     decided, detector.describe(), decided + 1)
        return decided


def variance_reading(groups: Sequence[dict[str, Any]], state: Any, step: int, extra: Optional[torch.Tensor],
                     process_group: Optional[dist.ProcessGroup], steps_capped: bool) -> VarianceReading:
    """What the freeze detector measures after warmup step ``step``: ``(numel, v, correction, beta2)`` for every
    trainable parameter of the compressed param groups, in order (the update will use ``v / correction``, the
    variance's bias correction, 1 without it; ``v`` is ``None`` where the parameter has no variance yet;
    ``compress=False`` groups are left out: their variance is never frozen), the optimizer's ``extra`` settling
    figures, the parameters' device and the ``process_group`` that decides."""
    variances = []
    for group in groups:
        if group["compress"]:
            b2, correction = group["betas"][1], bias_corrections(group, step, step)[1]
            variances += [(p.numel(), state[p].get("exp_avg_sq"), correction, b2) for p in trainable(group)]
    params = [p for group in groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    return VarianceReading(variances, extra, device, process_group, steps_capped)


def state_figures(groups: Sequence[dict[str, Any]], state: Any, name: str) -> torch.Tensor:
    """A per-tensor figure that must settle before an automatic freeze (``_settling_figures``), from the 0-dim state
    entry ``name`` of every trainable parameter of the compressed groups (0 where it has none yet): one float64 tensor
    on the first parameter's device, which the detector reads with its other figures, once per check."""
    params = [p for group in groups for p in trainable(group) if group["compress"]]
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    home = params[0].device
    return torch.stack([state[p][name].to(home) if name in state[p]
                        else torch.full((), 0.0, dtype=torch.float64, device=home) for p in params])
