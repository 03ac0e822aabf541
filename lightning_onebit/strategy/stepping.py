"""What both strategies share, in one place (:class:`CompressedStepping`): the compressed optimizer they drive (taken
on at ``setup_optimizers``) and its stage, the phase announcements, the training losses that ``freeze_step="auto"``
reads, the run's length its warmup and schedules follow, replicas made identical before each validation, before each
checkpoint and at the end of ``fit`` (0/1 Adam's local steps) and checked to be, the compression error feedback
across checkpoints (:mod:`~lightning_onebit.strategy.error_feedback`) with the sidecars removed with their
checkpoint, and the communication counted; and how a callback finds them (:func:`onebit_strategy`,
:func:`onebit_optimizer`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import assert_replicas_identical
from lightning_onebit.optim import CompressedOptimizer, OnebitStage
from lightning_onebit.optim.sharded import is_sharded
from lightning_onebit.strategy.auto_freeze import default_auto_freeze_bound, fit_schedule_to_run, run_length
from lightning_onebit.strategy.auto_freeze import warn_if_run_ends_in_warmup
from lightning_onebit.strategy.checkpoint import owned_sidecar, remove_sidecar
from lightning_onebit.strategy.error_feedback import ErrorFeedbackKeeper, ErrorFeedbackPolicy
from lightning_onebit.strategy.stage_log import StageLog

log = logging.getLogger(__name__)


class CompressedStepping(ParallelStrategy):
    """The Lightning ``ParallelStrategy`` both compressed strategies are, before their own Lightning base
    (``class OnebitStrategy(CompressedStepping, DDPStrategy)``, ``class OnebitFSDPStrategy(CompressedStepping,
    ModelParallelStrategy)``): it owns what it keeps (set here and in :meth:`_take_optimizer`) and otherwise uses
    Lightning's strategy interface and the concrete class's ``strategy_name``. A strategy calls
    ``self._error_feedback``'s ``save`` and ``load`` from its ``save_checkpoint`` and ``load_checkpoint``, provides
    :attr:`warmup_communication`, and overrides :meth:`_replicas` when its replicas are not the ranks of the
    optimizer's process group.

    Args:
        error_feedback: the strategy's ``error_feedback`` (:class:`~lightning_onebit.strategy.error_feedback.
            ErrorFeedbackKeeper`). Default ``"keep"``.
        stage_log: what announces the phases (:class:`~lightning_onebit.strategy.stage_log.StageLog`). Default: one
            that speaks as ``strategy_name``.
        kwargs: the Lightning base strategy's arguments.
    """

    #: The run's length in optimizer steps, or ``None`` (:func:`~lightning_onebit.strategy.auto_freeze.run_length`).
    _run_length = staticmethod(run_length)

    def __init__(self, *, error_feedback: ErrorFeedbackPolicy = "keep", stage_log: Optional[StageLog] = None,
                 **kwargs: Any) -> None:
        self._error_feedback = ErrorFeedbackKeeper(error_feedback, self.strategy_name, type(self).__name__)
        self._onebit_optimizer: Optional[CompressedOptimizer] = None
        self._stage_log = stage_log if stage_log is not None else StageLog(self.strategy_name)
        super().__init__(**kwargs)

    def _take_optimizer(self, trainer: "pl.Trainer", optimizer: CompressedOptimizer) -> None:
        """This fit's compressed optimizer, at ``setup_optimizers`` (pointed at its process group already): the kernel
        backend agreed, ``freeze_step="auto"`` bounded and schedules scaled to the run's length, a warning if the run
        would end in the warmup, every loss recorded by :meth:`pre_backward`, its phases announced anew."""
        optimizer.agree_kernel_backend()  # replicas stay identical only if every rank runs the same kernels
        self._default_auto_freeze_bound(trainer, optimizer)
        fit_schedule_to_run(trainer, optimizer, self.strategy_name, self._run_length)
        self._warn_if_run_ends_in_warmup(trainer, optimizer)
        optimizer.observe_losses_from_caller()  # pre_backward records every loss, micro-batches and manual steps too
        self._onebit_optimizer = optimizer
        self._stage_log.new_fit()

    @classmethod
    def _default_auto_freeze_bound(cls, trainer: "pl.Trainer", optimizer: CompressedOptimizer) -> None:
        default_auto_freeze_bound(trainer, optimizer, cls._run_length, cls.strategy_name)

    @classmethod
    def _warn_if_run_ends_in_warmup(cls, trainer: "pl.Trainer", optimizer: CompressedOptimizer) -> None:
        warn_if_run_ends_in_warmup(trainer, optimizer, cls._run_length, cls.strategy_name)

    @property
    def warmup_communication(self) -> CommunicationCounters:
        """This rank's counters of the full-precision gradient averages (the warmup's, and 0/1 Adam's variance
        steps'); :attr:`communication` adds the compressed exchange's. The strategy's."""
        raise NotImplementedError

    @property
    def communication(self) -> CommunicationCounters:
        """This rank's cumulative communication: the warmup's full-precision gradient averages
        (:attr:`warmup_communication`) plus the compressed exchanges (the optimizer's ``communication``)."""
        total = self.warmup_communication
        return total if self._onebit_optimizer is None else total + self._onebit_optimizer.communication

    def remove_checkpoint(self, filepath: Any) -> None:
        sidecar = owned_sidecar(filepath, self.global_rank)  # before the file goes (a link owns no sidecar)
        super().remove_checkpoint(filepath)
        remove_sidecar(sidecar)

    @property
    def onebit_optimizer(self) -> Optional[CompressedOptimizer]:
        """The compressed optimizer (OnebitAdam, ZeroOneAdam or OnebitLamb) this strategy drives (``None`` before
        setup)."""
        return self._onebit_optimizer

    @property
    def stage(self) -> OnebitStage:
        """Stage of the next optimizer step (warmup until an optimizer is connected)."""
        return OnebitStage.WARMUP if self._onebit_optimizer is None else self._onebit_optimizer.stage

    def _replicas(self) -> tuple[Optional[dist.ProcessGroup], Optional[list[list[int]]]]:
        """Which ranks hold replicas of each other: ``(group, sets)``, the process group to compare over and the lists
        of its ranks that must be identical (``None``: all of them). Here the compressed optimizer's process group,
        whose ranks all hold the same parameters."""
        return (None if self._onebit_optimizer is None else self._onebit_optimizer.process_group), None

    def assert_replicas_identical(self, module: Module) -> None:
        """Compare a checksum of every parameter of ``module`` (of each sharded parameter's local shard) between the
        ranks that hold replicas of it (a collective: every rank calls it) and raise ``RuntimeError`` on every rank,
        naming the parameters that differ (:func:`~lightning_onebit.comm.assert_replicas_identical`). Under
        :class:`~lightning_onebit.OnebitFSDPStrategy` the replicas of a shard are the ranks that hold it on every
        node."""
        named = [(name, p.to_local() if is_sharded(p) else p) for name, p in module.named_parameters()]
        group, sets = self._replicas()
        assert_replicas_identical(named, group, sets)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict, after syncing the replicas if the optimizer took local steps since its last sync
        (:meth:`CompressedOptimizer.synchronize`, a collective: every rank saves), so a checkpoint holds the model
        every rank agrees on and a resume continues exactly."""
        onebit = self._onebit_optimizer
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if onebit is not None and fitting and onebit.synchronize():
            log.debug("%s: replicas synchronised before saving a checkpoint", self.strategy_name)
        return super().lightning_module_state_dict()

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
        super().on_train_start()
        self._error_feedback.on_train_start(self._onebit_optimizer, self.global_rank)

    def teardown(self) -> None:
        self._error_feedback.end_run()  # a checkpoint loaded by validate/test, or by a fit that failed before training
        super().teardown()

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._onebit_optimizer is not None:
            self._stage_log.before_step(self._onebit_optimizer, self.lightning_module)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # freeze_step="auto" waits for the training loss to leave its initial plateau (AutoFreeze.loss_drop)
        if self._onebit_optimizer is not None:
            self._onebit_optimizer.observe_loss(closure_loss)
        super().pre_backward(closure_loss)

    def on_validation_start(self) -> None:
        # Validate the model the ranks share: after an optimizer's local steps (ZeroOneAdam) each rank holds its own
        # replica until the next sync, and metrics synced over ranks would mix replicas that no checkpoint holds. A
        # collective when it acts; every rank runs the validation loop.
        super().on_validation_start()
        if self._onebit_optimizer is not None and self._onebit_optimizer.synchronize():
            log.debug("%s: replicas synchronised before validation", self.strategy_name)

    def on_train_end(self) -> None:
        # An optimizer with local steps (ZeroOneAdam) ends fit with every rank's replica identical.
        if self._onebit_optimizer is not None and self._onebit_optimizer.synchronize():
            rank_zero_info(f"{self.strategy_name}: replicas synchronised at the end of fit (local steps since the last "
                           "sync)")
        super().on_train_end()


def onebit_strategy(trainer: "pl.Trainer", who: str) -> CompressedStepping:
    """``trainer``'s strategy if it is one of this package's (``onebit_adam`` or ``onebit_fsdp``), else a
    ``ValueError`` naming ``who`` (the callback that needs it) and the fix."""
    strategy = trainer.strategy
    if not isinstance(strategy, CompressedStepping):
        raise ValueError(
            f"{who} needs the 'onebit_adam' or 'onebit_fsdp' strategy (lightning_onebit.OnebitStrategy, "
            f"OnebitFSDPStrategy), but the Trainer uses {type(strategy).__name__}. Pass "
            "Trainer(strategy='onebit_adam') or remove the callback."
        )
    return strategy


def onebit_optimizer(trainer: "pl.Trainer", who: str) -> CompressedOptimizer:
    """The compressed optimizer ``trainer``'s strategy drives (:func:`onebit_strategy`); ``RuntimeError`` before
    the strategy has one."""
    optimizer = onebit_strategy(trainer, who).onebit_optimizer
    if optimizer is None:
        raise RuntimeError(f"{who}: the onebit_adam strategy has no OnebitAdam connected yet")
    return optimizer
