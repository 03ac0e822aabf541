"""ErrorFeedbackCheckpoint: what happens to each rank's compression error buffers when training resumes."""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_onebit._docs import docs_pointer
from lightning_onebit.callbacks._common import _onebit_optimizer, _onebit_strategy
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY, OnebitStrategy

class ErrorFeedbackCheckpoint(Callback):
    """What happens to the compression error buffers when training resumes from a checkpoint.

    Each rank holds its own worker and server error buffers (they are what makes 1-bit compression unbiased over
    time). Lightning writes only rank 0's state, so they need a policy:

    * ``"reset"`` (default, DeepSpeed's behaviour): they restart from zero after a load; the norm that was dropped
      (rank 0's buffers at save time) is logged. The 1-bit Adam paper reports that occasional resets do not hurt.
    * ``"keep"``: every rank saves its own buffers in a sidecar file next to the checkpoint
      (``<checkpoint>.onebit-rank<r>``, see :mod:`lightning_onebit.strategy.sidecar`). On resume each rank validates
      its own file: missing, unreadable, corrupt (checksum), stale or foreign (another checkpoint's or another rank's
      file), or mismatched (world size, topology, bucket layout). The ranks then agree with one small collective: if
      every rank can restore, all do, and the resumed run continues bitwise as an uninterrupted one would; if any rank
      cannot, **every** rank resets, and a warning names each such rank, its file and the reason. A bad file never
      stops training under ``keep``.
    * ``"require"``: as ``keep``, but if any rank cannot restore, every rank raises ``RuntimeError`` naming the
      ranks, files and reasons, at the start of training, before any training collective.

    Sidecars are written atomically with the checkpoint's permission bits, follow a checkpoint reached through a
    symbolic link (``save_last="link"``), and are removed with their checkpoint (e.g. by
    ``ModelCheckpoint(save_top_k=...)``), each rank removing its own.

    Restored buffers stay restored when the momentum buckets are laid out anew after the resume (a checkpoint saved
    with ``overlap=False`` resumed with ``overlap=True``, whose hook lays the momenta out like DDP's gradient buckets
    at the second step): the optimizer carries them into the new layout coordinate by coordinate, and logs it.

    Args:
        policy: ``"reset"``, ``"keep"`` or ``"require"``. Default ``"reset"``.
    """

    _STATE_NAME = "error_feedback"
    _POLICIES = ("reset", "keep", "require")

    def __init__(self, policy: Literal["reset", "keep", "require"] = "reset") -> None:
        if policy not in self._POLICIES:
            raise ValueError(f"ErrorFeedbackCheckpoint policy must be one of {self._POLICIES}, got {policy!r}")
        self.policy = policy
        self._pending: Optional[dict[str, Any]] = None
        self._status: Optional[dict[str, Any]] = None
        self._saved_norm: Optional[float] = None
        self._strategy: Optional[OnebitStrategy] = None
        self._loaded = False
        self.restored: Optional[bool] = None  # after a resume: True if buffers were restored, False if reset

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._strategy = _onebit_strategy(trainer, "ErrorFeedbackCheckpoint")

    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        optimizer = _onebit_optimizer(trainer, "ErrorFeedbackCheckpoint")
        if self.policy != "reset":
            per_rank = checkpoint.setdefault(PER_RANK_STATE_KEY, {})
            per_rank[self._STATE_NAME] = optimizer.error_feedback_state_dict()

    def state_dict(self) -> dict[str, Any]:
        # Lightning collects callback state before it calls `on_save_checkpoint`: measure the norm here, or the
        # checkpoint would carry the norm of the previous save.
        strategy = self._strategy
        optimizer = None if strategy is None else strategy.onebit_optimizer
        if optimizer is not None:
            self._saved_norm = optimizer.compression.error_feedback_norm()
        world_size = None if strategy is None else strategy.world_size
        return {"policy": self.policy, "error_norm_rank0": self._saved_norm, "world_size": world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_norm = state_dict.get("error_norm_rank0")
        self._loaded = True

    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        self._loaded = True
        self._pending = (checkpoint.get(PER_RANK_STATE_KEY) or {}).get(self._STATE_NAME)
        self._status = checkpoint.get(PER_RANK_STATUS_KEY)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Runs after the optimizer state was restored (which resets the error buffers), on every rank, before the
        # first training step: the place for the ranks to agree.
        if not self._loaded:
            return
        self._loaded = False
        optimizer = _onebit_optimizer(trainer, "ErrorFeedbackCheckpoint")
        pending, status = self._pending, self._status or {}
        self._pending = self._status = None
        if self.policy == "reset":
            self._reset(optimizer)
            return
        reason = status.get("reason", "the strategy found no per-rank file for this rank")
        if reason is None and pending is None:
            reason = "the per-rank file holds no error feedback (saved without ErrorFeedbackCheckpoint keep)"
        if reason is None:
            reason = optimizer.error_feedback_mismatch(pending)
        verdicts = _gather_verdicts((trainer.global_rank, status.get("file"), reason), optimizer.process_group)
        failures = [(rank, file, why) for rank, file, why in verdicts if why is not None]
        if not failures:
            optimizer.load_error_feedback_state_dict(pending)
            self.restored = True
            rank_zero_info(
                f"ErrorFeedbackCheckpoint: compression error feedback restored on every rank ({len(verdicts)} ranks)"
            )
            return
        text = _failures_text(failures)
        if self.policy == "require":
            raise RuntimeError(
                f"ErrorFeedbackCheckpoint(policy='require'): compression error feedback cannot be restored: {text}. "
                "Resume from a checkpoint whose per-rank files are intact and match this run, or use "
                f"policy='keep' to reset instead; {docs_pointer('guides/checkpoints')}"
            )
        rank_zero_warn(
            f"ErrorFeedbackCheckpoint(policy='keep'): error feedback reset on every rank because {text}; "
            f"{docs_pointer('guides/checkpoints')}"
        )
        self._reset(optimizer)

    def _reset(self, optimizer: CompressedOptimizer) -> None:
        optimizer.reset_error_feedback()
        self.restored = False
        norm = "unknown" if self._saved_norm is None else f"{self._saved_norm:.4g}"
        rank_zero_info(f"ErrorFeedbackCheckpoint: compression error feedback reset (rank 0 norm at save: {norm})")


def _failures_text(failures: list[tuple]) -> str:
    """``rank r (file): reason`` for each failing rank, ranks with the same reason together (a node without its
    sidecars: one reason, not one per rank)."""
    by_reason: dict[str, list[str]] = {}
    for rank, file, why in failures:
        by_reason.setdefault(why, []).append(f"rank {rank} ({file})")
    return "; ".join(f"{', '.join(ranks)}: {why}" for why, ranks in by_reason.items())


def _gather_verdicts(mine: tuple, group: Any) -> list[tuple]:
    """Every rank's ``(rank, file, reason)``, in rank order (one small all_gather_object)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    return everyone
