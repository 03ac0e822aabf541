"""The optimizer's side of ``freeze_step="auto"``: the options checked at construction, the
:class:`~lightning_onebit.optim.auto_freeze.FreezeDetector` it feeds, the training losses it records and the variance
readings it takes after each warmup step. The rule that decides the freeze step is
:mod:`~lightning_onebit.optim.auto_freeze`'s.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_integer
from lightning_onebit.comm.state import CompressedAllreduceState
from lightning_onebit.optim.auto_freeze import FreezeDetector, VarianceReading
from lightning_onebit.optim.auto_freeze_config import AutoFreeze
from lightning_onebit.optim.groups import trainable

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


class AutoFreezeMixin:
    """``freeze_step="auto"`` for :class:`~lightning_onebit.optim.CompressedOptimizer`, which sets the attributes
    below and calls :meth:`_observe_variance` after each warmup step while the freeze step is unknown."""

    #: The last warmup step: an int, or ``None`` while ``freeze_step="auto"`` is still measuring.
    freeze_step: Optional[int]
    auto_freeze: Optional[AutoFreeze]  # the rule's options with freeze_step="auto", else None
    _detector: Optional[FreezeDetector]  # created at the first warmup step (needs the betas)
    _observe_closure_loss: bool  # whether step(closure) records the closure's loss (see observe_losses_from_caller)
    param_groups: list[dict[str, Any]]
    state: Any
    _step: int
    compression: CompressedAllreduceState
    process_group: Optional[dist.ProcessGroup]
    _settling_figures: Callable[[], Optional[torch.Tensor]]  # the optimizer's subclass hooks
    _steps_capped: Callable[[], bool]

    def _init_freeze(self, freeze_step: Union[int, str], auto_freeze: Optional[AutoFreeze]) -> None:
        """Set the freeze attributes above from the options (checked by :func:`check_freeze_options`)."""
        self.freeze_step = None if freeze_step == "auto" else freeze_step
        self.auto_freeze = (auto_freeze or AutoFreeze()) if freeze_step == "auto" else None
        self._detector = None
        self._observe_closure_loss = True

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Record a training loss for ``freeze_step="auto"``, whose :class:`~lightning_onebit.AutoFreeze` ``loss_drop``
        guard waits for the loss to leave its initial plateau. Call it every step (or every micro-batch) on every rank,
        before :meth:`step`; a ``closure`` passed to :meth:`step` is observed too. The Lightning strategy calls it
        from its ``backward``. A scalar tensor is summed on its device and read once per check, so this adds no host
        synchronisation per step. Does nothing once the freeze step is known, or with an integer ``freeze_step``."""
        if self.auto_freeze is None or self.freeze_step is not None:
            return
        self._ensure_detector().record_loss(loss)

    def observe_losses_from_caller(self) -> None:
        """Declare that the caller passes every training loss to :meth:`observe_loss` itself, so that the loss a
        ``closure`` given to :meth:`step` returns is not recorded a second time. The Lightning strategy does this: it
        records every loss in its ``backward`` (micro-batches and manual optimization included)."""
        self._observe_closure_loss = False

    def _ensure_detector(self) -> FreezeDetector:
        if self._detector is None:
            assert self.auto_freeze is not None
            self._detector = FreezeDetector(self.auto_freeze, self.param_groups[0]["betas"][1], type(self).__name__)
        return self._detector

    @property
    def freeze_detector(self) -> Optional[FreezeDetector]:
        """The measuring state of ``freeze_step="auto"`` (its figures, ``describe()``), ``None`` with an int."""
        return self._ensure_detector() if self.auto_freeze is not None else None

    def _variance_reading(self) -> VarianceReading:
        """What the freeze detector measures now: ``(numel, v, correction, beta2)`` for every trainable parameter of
        the compressed param groups, in order (the update will use ``v / correction``, 1 without bias correction;
        ``v`` is ``None`` where the parameter has no variance yet; ``compress=False`` groups are left out: their
        variance is never frozen), the subclass's settling figures, the parameters' device and the process group
        that decides (the default group when the parameters are sharded)."""
        variances = []
        for group in self.param_groups:
            if not group["compress"]:
                continue
            b2 = group["betas"][1]
            correction = 1 - b2**self._step if group["bias_correction"] else 1.0
            variances += [(p.numel(), self.state[p].get("exp_avg_sq"), correction, b2) for p in trainable(group)]
        params = [p for group in self.param_groups for p in group["params"]]
        device = params[0].device if params else torch.device("cpu")
        # sharded parameters: every rank measures its own shard, so every rank (not only the replicate group, which
        # holds one shard) must agree, or the shards of a node would end their warmups at different steps
        agree_over = None if self.shards else self.process_group
        return VarianceReading(variances, self._settling_figures(), device, agree_over, self._steps_capped())

    def _observe_variance(self) -> None:
        """freeze_step='auto': measure after this warmup step; end the warmup here if the detector says so."""
        detector = self._ensure_detector()
        decided = detector.observe(self._step, self._variance_reading)
        if decided is not None:
            self.freeze_step = decided
            if self.compression.rank() == 0:
                log.info(
                    "%s: freeze_step='auto' decided %d (%s); the compression stage starts at step %d",
                    type(self).__name__,
                    decided,
                    detector.describe(),
                    decided + 1,
                )
