"""Precision plugins for ``onebit_fsdp`` whose gradient clipping sees the sharded parameters.

Lightning clips the gradients of ``precision_plugin.main_params(optimizer)``, the optimizer's parameters. A compressed
optimizer over FSDP2's ``DTensor`` parameters holds plain stand-ins over the local shards
(:mod:`lightning_onebit.optim.sharded`), whose norms are those of one shard. These plugins hand Lightning the
``DTensor`` parameters instead, so ``clip_grad_norm_`` reduces the norm over the shard group (the whole tensor) and
clipping by norm or by value acts on the gradients the optimizer then reads (the stand-ins' gradients are the
``DTensor`` gradients' local shards). Where gradients are not averaged across nodes (the compression stage), clipping
by norm scales every rank's gradient by one factor (:mod:`~lightning_onebit.strategy.clipping`): the norm of each
node's gradient is summed over the shard group, then agreed over the replicate group.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.clipping import AgreedClipping

__all__ = ["ShardedMixedPrecision", "ShardedPrecision", "sharded_precision"]


class _ShardedMainParams:
    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The optimizer's parameters, a sharded one as its ``DTensor`` (not the stand-in over its local shard)."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not (isinstance(inner, CompressedOptimizer) and inner.shards):
            yield from super().main_params(optimizer)  # type: ignore[misc]
            return
        for group in inner.param_groups:
            for p in group["params"]:
                owner = inner.shards.dtensor_of(p)
                yield p if owner is None else owner


class ShardedPrecision(_ShardedMainParams, AgreedClipping, Precision):
    """``Precision`` ("32-true") with clipping over sharded parameters, by one factor on every rank."""


class ShardedMixedPrecision(_ShardedMainParams, AgreedClipping, MixedPrecision):
    """``MixedPrecision`` ("bf16-mixed", autocast) with clipping over sharded parameters, by one factor on every
    rank."""


def sharded_precision(plugin: Any) -> Any:
    """``plugin`` as its sharded-clipping counterpart where one exists (Lightning's plain ``Precision`` and
    ``MixedPrecision``); any other plugin unchanged."""
    if type(plugin) is Precision:
        return ShardedPrecision()
    if type(plugin) is MixedPrecision:
        return ShardedMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    return plugin
