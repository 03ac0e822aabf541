"""What the strategy tells the user as the steps go by: each new phase of the optimizer, once, and, once per strategy,
what gradient clipping by norm clips in the compression stage."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._docs import docs_pointer
from lightning_onebit.optim import CompressedOptimizer, OnebitStage, StepKind
from lightning_onebit.strategy.clipping import AgreedClipping

#: The page that says what clipping clips in each stage.
_DOCS = docs_pointer("guides/configuration", "gradient-clipping")


class StageLog:
    """Announces the optimizer's phase (``describe_phase``) when it changes and, once, how clipping by norm works in
    the compression stage: one factor for every rank with this package's precision plugins (info), each rank by its
    own norm with any other plugin (a warning).

    Args:
        name: the strategy's name, which starts every message. Default ``"onebit_adam"``.
        gradients: what each rank's gradient is in the compression stage, in the messages. Default ``"each rank's
            local gradient"``.
    """

    def __init__(self, name: str = "onebit_adam", gradients: str = "each rank's local gradient") -> None:
        self.name = name
        self.gradients = gradients
        self.announced_phase: Optional[StepKind] = None  # the optimizer phase last announced (describe_phase)
        self.told_clipping = False

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
            self._tell_clipping(module)

    def _tell_clipping(self, module: Optional["pl.LightningModule"]) -> None:
        trainer = module.trainer if module is not None else None
        if (self.told_clipping or trainer is None or not trainer.gradient_clip_val
                or trainer.gradient_clip_algorithm == "value"):  # elementwise: the same in both stages
            return
        self.told_clipping = True
        plugin = trainer.precision_plugin
        if isinstance(plugin, AgreedClipping):
            rank_zero_info(
                f"{self.name}: gradient clipping by norm in the compression stage scales {self.gradients} by one "
                "factor on every rank, from an estimate of the averaged gradient's norm (one all-reduce of 257 numbers "
                f"per step); {_DOCS}"
            )
        else:
            rank_zero_warn(
                f"{self.name}: gradient clipping in the compression stage clips {self.gradients} by its own norm with "
                f"the precision plugin {type(plugin).__name__} (gradients are no longer averaged before the "
                f"optimizer; 32-true, 16-mixed and bf16-mixed clip every rank by one factor); {_DOCS}"
            )
