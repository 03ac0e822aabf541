"""ErrorFeedbackCheckpoint: chooses what happens to each rank's compression error buffers when training resumes (the
strategy does it: :mod:`lightning_onebit.strategy.error_feedback`)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_onebit.strategy import OnebitFSDPStrategy, OnebitStrategy
from lightning_onebit.strategy.error_feedback import check_error_feedback_policy
from lightning_onebit.strategy.stepping import onebit_strategy


class ErrorFeedbackCheckpoint(Callback):
    """Chooses what happens to the compression error buffers when training resumes from a checkpoint, overriding the
    strategy's ``error_feedback`` argument.

    The strategy (:class:`~lightning_onebit.OnebitStrategy`, :class:`~lightning_onebit.OnebitFSDPStrategy`) saves,
    validates and restores the buffers itself and keeps them by default, without this callback; the callback only sets
    the strategy's policy at setup (logged at info level when it differs from the strategy's argument). Each rank
    holds its own worker and server error buffers (they are what makes 1-bit compression unbiased over time), and
    Lightning writes only rank 0's checkpoint, so they need a policy:

    * ``"keep"`` (default, and the strategy's default): every rank saves its own buffers in a sidecar file next to the
      checkpoint (``<checkpoint>.onebit-rank<r>``, see :mod:`lightning_onebit.strategy.sidecar`). On resume each rank
      validates its own file: missing, unreadable, corrupt (checksum), stale or foreign (another checkpoint's or
      another rank's file), or mismatched (world size, topology, bucket layout). The ranks then agree with one small
      collective: if every rank can restore, all do, and the resumed run continues bitwise as an uninterrupted one
      would; if any rank cannot, **every** rank resets, and a warning names each such rank, its file and the reason.
      A bad file never stops training under ``keep``.
    * ``"reset"`` (DeepSpeed's behaviour): no sidecars; the buffers restart from zero after a load, and the norm that
      was dropped (rank 0's buffers at save time) is logged. The 1-bit Adam paper reports that occasional resets do
      not hurt.
    * ``"require"``: as ``keep``, but if any rank cannot restore, every rank raises ``RuntimeError`` naming the
      ranks, files and reasons, at the start of training, before any training collective.

    Sidecars are written atomically with the checkpoint's permission bits, follow a checkpoint reached through a
    symbolic link (``save_last="link"``), and are removed with their checkpoint (e.g. by
    ``ModelCheckpoint(save_top_k=...)``), each rank removing its own.

    Restored buffers stay restored when the momentum buckets are laid out anew after the resume (a checkpoint saved
    with ``overlap=False`` resumed with ``overlap=True``, whose hook lays the momenta out like DDP's gradient buckets
    at the second step): the optimizer carries them into the new layout coordinate by coordinate, and logs it.

    Args:
        policy: ``"keep"``, ``"reset"`` or ``"require"``. Default ``"keep"``.
    """

    def __init__(self, policy: Literal["keep", "reset", "require"] = "keep") -> None:
        self.policy = check_error_feedback_policy(policy, "ErrorFeedbackCheckpoint policy")
        self._strategy: Optional[Union[OnebitStrategy, OnebitFSDPStrategy]] = None

    @property
    def restored(self) -> Optional[bool]:
        """After a resume: ``True`` if every rank restored its error buffers, ``False`` if every rank reset them;
        ``None`` before any resume (the strategy's :attr:`~lightning_onebit.OnebitStrategy.error_feedback_restored`)."""
        return None if self._strategy is None else self._strategy.error_feedback_restored

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            strategy = onebit_strategy(trainer, "ErrorFeedbackCheckpoint")
            strategy.set_error_feedback(self.policy, chosen_by="ErrorFeedbackCheckpoint")
            self._strategy = strategy

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Checkpoints written before the strategy kept the error feedback hold this callback's state ({"policy",
        # "error_norm_rank0", "world_size"}); the strategy reads the norm from it. Nothing else to restore.
        pass
