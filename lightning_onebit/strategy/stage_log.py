"""What the strategy tells the user as the steps go by: each new phase of the optimizer, once, and, once per strategy,
that gradient clipping in the compression stage is local."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit.optim import CompressedOptimizer, OnebitStage, StepKind


class StageLog:
    """Announces the optimizer's phase (``describe_phase``) when it changes and warns about local clipping once."""

    def __init__(self, name: str = "onebit_adam", local_clipping_warning: str = (
        "onebit_adam: gradient clipping in the compression stage clips each rank's local gradient by its local norm "
        "(gradients are no longer averaged before the optimizer)."
    )) -> None:
        self.name = name  # the strategy's name, which starts every announcement
        self.local_clipping_warning = local_clipping_warning
        self.announced_phase: Optional[StepKind] = None  # the optimizer phase last announced (describe_phase)
        self.warned_local_clipping = False

    def new_fit(self) -> None:
        """A new ``fit``'s optimizer: its first phase is announced again."""
        self.announced_phase = None

    def before_step(self, optimizer: CompressedOptimizer, module: Optional["pl.LightningModule"]) -> None:
        """Before ``optimizer``'s step in the run of ``module``."""
        phase, sentence = optimizer.describe_phase()
        if phase is not self.announced_phase:
            rank_zero_info(f"{self.name}: {sentence}")
            self.announced_phase = phase
        if optimizer.stage is OnebitStage.COMPRESSION:
            self._warn_local_clipping(module)

    def _warn_local_clipping(self, module: Optional["pl.LightningModule"]) -> None:
        trainer = module.trainer if module is not None else None
        if self.warned_local_clipping or trainer is None or not trainer.gradient_clip_val:
            return
        rank_zero_warn(self.local_clipping_warning)
        self.warned_local_clipping = True
