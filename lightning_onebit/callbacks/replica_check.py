"""ReplicaCheck: fails loudly if the model replicas stop being bitwise identical."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_onebit._checks import check_integer
from lightning_onebit.strategy.stepping import onebit_optimizer, onebit_strategy


class ReplicaCheck(Callback):
    """Fails loudly if the model replicas stop being bitwise identical.

    In both stages every rank applies the same update to the same parameters, so replicas must stay bit-identical
    with no parameter broadcast (with :class:`~lightning_onebit.ZeroOneAdam`, after every sync: a check that falls
    between syncs waits for the next one). Ranks that run different kernels (see ``OnebitAdam.agree_kernel_backend``), a
    nondeterministic custom op or a corrupted rank would make them drift apart silently. Every ``every_n_steps``
    optimizer steps this callback compares a checksum of every parameter's bits across ranks
    (:meth:`OnebitStrategy.assert_replicas_identical`: one pass over the parameters and an all-gather of one integer per
    parameter tensor) and raises ``RuntimeError`` on every rank, naming the parameters that differ. Under
    ``onebit_fsdp`` each rank's local shards are compared with those of the ranks that hold the same shards on the
    other nodes.

    Args:
        every_n_steps: check after every this many optimizer steps (``>= 1``). Default ``100``.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = check_integer(every_n_steps, "ReplicaCheck every_n_steps")
        self.checks = 0
        self._last_step = -1
        self._due = False  # a check fell between two syncs of an optimizer with local steps

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            onebit_strategy(trainer, "ReplicaCheck")

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step == self._last_step:
            return
        self._last_step = step
        self._due = self._due or step % self.every_n_steps == 0
        optimizer = onebit_optimizer(trainer, "ReplicaCheck")
        if not self._due or not optimizer.replicas_in_sync:  # (rank-identical: the sync schedule is)
            return
        self._due = False
        trainer.strategy.assert_replicas_identical(pl_module)
        self.checks += 1
