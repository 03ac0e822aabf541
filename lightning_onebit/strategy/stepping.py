"""The Lightning hooks both strategies share around the optimizer's step: the phase announcements, the training
losses that ``freeze_step="auto"`` reads, replicas made identical before each validation and at the end of ``fit``
(0/1 Adam's local steps), and the compression error feedback restored or reset at the start of training after a
resume (:mod:`~lightning_onebit.strategy.error_feedback`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.error_feedback import ErrorFeedbackKeeper, ErrorFeedbackPolicy
from lightning_onebit.strategy.stage_log import StageLog

log = logging.getLogger(__name__)


class CompressedStepping:
    """Mixed into a Lightning strategy before its base class; the strategy sets ``_onebit_optimizer`` (at
    ``setup_optimizers``), ``_stage_log``, ``_error_feedback`` (in ``__init__``) and ``strategy_name``, and calls
    ``_error_feedback``'s ``save`` and ``load`` from its ``save_checkpoint`` and ``load_checkpoint``."""

    _onebit_optimizer: Optional[CompressedOptimizer]
    _stage_log: StageLog
    _error_feedback: ErrorFeedbackKeeper
    strategy_name: str

    @property
    def error_feedback(self) -> str:
        """What happens to the compression error feedback when training resumes from a checkpoint: ``"keep"``,
        ``"reset"`` or ``"require"`` (the ``error_feedback`` argument, or the policy an
        :class:`~lightning_onebit.ErrorFeedbackCheckpoint` chose, which overrides it)."""
        return self._error_feedback.policy

    def set_error_feedback(self, policy: ErrorFeedbackPolicy, chosen_by: Optional[str] = None) -> None:
        """Set :attr:`error_feedback` (``ValueError`` for another value). ``chosen_by``: the callback that chooses it,
        named in the messages; it overrides the ``error_feedback`` argument, which is logged at info level when the
        two differ. ``None`` (default): as if the strategy had been given ``error_feedback=policy``."""
        self._error_feedback.choose(policy, chosen_by)

    @property
    def error_feedback_restored(self) -> Optional[bool]:
        """After a resume: ``True`` if every rank restored its compression error feedback from the checkpoint,
        ``False`` if every rank reset it; ``None`` before any resume."""
        return self._error_feedback.restored

    def on_train_start(self) -> None:
        # After Lightning restored the optimizer state (which resets the error buffers), on every rank, after the
        # callbacks' on_train_start and before the first training step: the ranks agree to restore or reset.
        super().on_train_start()  # type: ignore[misc]
        self._error_feedback.on_train_start(self._onebit_optimizer, self.global_rank)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        self._error_feedback.end_run()  # a checkpoint loaded by validate/test, or by a fit that failed before training
        super().teardown()  # type: ignore[misc]

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

    def on_validation_start(self) -> None:
        # Validate the model the ranks share: after an optimizer's local steps (ZeroOneAdam) each rank holds its own
        # replica until the next sync, and metrics synced over ranks would mix replicas that no checkpoint holds. A
        # collective when it acts; every rank runs the validation loop.
        super().on_validation_start()  # type: ignore[misc]
        if self._onebit_optimizer is not None and self._onebit_optimizer.synchronize():
            log.debug("%s: replicas synchronised before validation", self.strategy_name)

    def on_train_end(self) -> None:
        # An optimizer with local steps (ZeroOneAdam) ends fit with every rank's replica identical.
        if self._onebit_optimizer is not None and self._onebit_optimizer.synchronize():
            rank_zero_info(f"{self.strategy_name}: replicas synchronised at the end of fit (local steps since the last "
                           "sync)")
        super().on_train_end()  # type: ignore[misc]
