"""What the callbacks share: finding the strategy and its compressed optimizer, with a clear error otherwise."""

from __future__ import annotations

import lightning.pytorch as pl

from typing import Union

from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy import OnebitFSDPStrategy, OnebitStrategy


def _onebit_strategy(trainer: "pl.Trainer", who: str) -> Union[OnebitStrategy, OnebitFSDPStrategy]:
    strategy = trainer.strategy
    if not isinstance(strategy, (OnebitStrategy, OnebitFSDPStrategy)):
        raise ValueError(
            f"{who} needs the 'onebit_adam' or 'onebit_fsdp' strategy (lightning_onebit.OnebitStrategy, "
            f"OnebitFSDPStrategy), but the Trainer uses {type(strategy).__name__}. Pass "
            "Trainer(strategy='onebit_adam') or remove the callback."
        )
    return strategy


def _onebit_optimizer(trainer: "pl.Trainer", who: str) -> CompressedOptimizer:
    optimizer = _onebit_strategy(trainer, who).onebit_optimizer
    if optimizer is None:
        raise RuntimeError(f"{who}: the onebit_adam strategy has no OnebitAdam connected yet")
    return optimizer


def _compressed_ids(optimizer: CompressedOptimizer) -> set[int]:
    """The parameters of the optimizer's compressed param groups (those ``compress=False`` groups leave out)."""
    return {id(p) for group in optimizer.param_groups if group["compress"] for p in group["params"]}
