"""The Lightning hooks both strategies share around the optimizer's step: the phase announcements, the training
losses that ``freeze_step="auto"`` reads, and replicas made identical at the end of ``fit`` (0/1 Adam's local steps)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.stage_log import StageLog


class CompressedStepping:
    """Mixed into a Lightning strategy before its base class; the strategy sets ``_onebit_optimizer`` (at
    ``setup_optimizers``), ``_stage_log`` and ``strategy_name``."""

    _onebit_optimizer: Optional[CompressedOptimizer]
    _stage_log: StageLog
    strategy_name: str

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._onebit_optimizer is not None:
            self._stage_log.before_step(self._onebit_optimizer, self.lightning_module)  # type: ignore[attr-defined]
        return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # freeze_step="auto" waits for the training loss to leave its initial plateau (AutoFreeze.loss_drop)
        if self._onebit_optimizer is not None:
            self._onebit_optimizer.observe_loss(closure_loss)
        super().pre_backward(closure_loss)  # type: ignore[misc]

    def on_train_end(self) -> None:
        # An optimizer with local steps (ZeroOneAdam) ends fit with every rank's replica identical.
        if self._onebit_optimizer is not None and self._onebit_optimizer.synchronize():
            rank_zero_info(f"{self.strategy_name}: replicas synchronised at the end of fit (local steps since the last "
                           "sync)")
        super().on_train_end()  # type: ignore[misc]
