"""Gradient clipping by norm where every rank holds its own gradient: one clip factor for every rank.

Lightning clips by norm with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters
(``precision_plugin.clip_grad_by_norm``), between backward and the optimizer's step. In the warmup (and 0/1 Adam's
variance steps) DDP, or FSDP's replica all-reduce, has averaged the gradients by then, so every rank clips the averaged
gradient ``g = mean_r g_r`` by its norm, as DDP does. In the compression stage nothing averages gradients before the
step: rank ``r`` holds its own ``g_r``, and the optimizer averages what it folds them into (the momenta) afterwards.
``clip_grad_norm_`` there would scale each ``g_r`` by its own norm: a factor that differs per rank, and a harsher one
than DDP's, since the norm of a local gradient is larger than that of the mean (each rank's sampling noise adds to it,
and averaging over ``P`` ranks divides that noise's square by ``P``).

The plugins here clip where gradients are local by :func:`clip_local_gradients_by_norm_`: every rank scales its
gradient by the same factor ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s), with ``norm`` an estimate
of ``||g||`` agreed by one all-reduce (:func:`estimate_mean_gradient_norm`). Since every fold the optimizer then
averages is linear in the gradient, the average of the clipped local gradients is ``factor * g``: DDP's clipped
gradient, exactly so when the estimate is exact. Elsewhere (warmup, variance steps) they are Lightning's, bit for bit.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.sharded import is_sharded

__all__ = [
    "AgreedClipping",
    "AgreedClippingMixedPrecision",
    "AgreedClippingPrecision",
    "agreed_clipping_precision",
    "clip_local_gradients_by_norm_",
    "estimate_mean_gradient_norm",
    "optimizer_with_local_gradients",
]


def optimizer_with_local_gradients(optimizer: Any) -> Optional[CompressedOptimizer]:
    """The compressed optimizer behind ``optimizer`` (a Lightning optimizer wrapper or the optimizer) when the gradients
    its next step reads were not averaged across its process group (the compression stage, 0/1 Adam's non-variance
    steps) and that group has several ranks; ``None`` otherwise (the gradients are DDP's averaged ones, or there is
    nothing to agree with)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(inner, CompressedOptimizer) or inner.needs_gradient_allreduce:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(inner.process_group) < 2:
        return None
    return inner


def _local_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of this rank's elements of ``grads`` (a ``DTensor``'s local shard), as a float32 scalar on
    the first gradient's device: one ``_foreach_norm`` per device and dtype, as ``clip_grad_norm_`` takes them; no
    host synchronisation."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if is_sharded(g) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    device = next(iter(by_kind))[0]
    norms = [n.to(device=device, dtype=torch.float32) for group in by_kind.values() for n in torch._foreach_norm(group)]
    return torch.stack(norms).square().sum()


def estimate_mean_gradient_norm(
    grads: list[torch.Tensor], group: Optional[dist.ProcessGroup], shard_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """An estimate of ``||mean_r g_r||``, the norm of the gradient averaged over the ranks ``r`` of ``group`` (each
    rank passes its own ``grads``), the same float32 scalar on every rank: ``sqrt(mean_r ||g_r||^2)``, from one
    all-reduce of one number over ``group``. With ``shard_group`` (sharded gradients: each rank holds a part of every
    replica's gradient) ``||g_r||^2`` is first summed over it (one more scalar all-reduce, the one ``clip_grad_norm_``
    over ``DTensor`` s makes anyway).

    It is never below the true norm: ``mean_r ||g_r||^2 = ||mean_r g_r||^2 + mean_r ||g_r - mean_s g_s||^2``, so it
    exceeds it by the spread of the ranks' gradients (their sampling noise, about ``(P - 1) / P`` of one rank's noise
    for ``P`` ranks). A NaN or inf on one rank makes it NaN or inf on every rank (as DDP's average would be); the
    collectives are issued the same way whatever the values, so no rank waits for another."""
    squares = _local_squares(grads)
    if shard_group is not None:
        dist.all_reduce(squares, group=shard_group)
    dist.all_reduce(squares, group=group)
    return squares.div_(dist.get_world_size(group)).sqrt_()


def clip_local_gradients_by_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, group: Optional[dist.ProcessGroup],
    shard_group: Optional[dist.ProcessGroup] = None,
) -> Optional[torch.Tensor]:
    """Scale every rank's gradients of ``parameters`` by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s
    factor) with ``norm`` = :func:`estimate_mean_gradient_norm` over ``group`` (and ``shard_group``): the same factor
    on every rank, so the ranks' clipped gradients average to the mean gradient clipped by that norm. A collective:
    every rank of ``group`` calls it at the same point, with or without gradients (a rank without any contributes 0).
    Returns ``norm`` (a tensor on the gradients' device). No host synchronisation."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:  # still join the collectives: the other ranks may hold gradients
        device = params[0].device if params else torch.device("cpu")
        grads = [torch.zeros(0, device=device)]
    norm = estimate_mean_gradient_norm(grads, group, shard_group)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, device_grads in by_device.items():
        torch._foreach_mul_(device_grads, factor.to(device))
    return norm


class AgreedClipping:
    """Mixed into a Lightning precision plugin before it: clipping by norm where gradients are local scales every
    rank's gradient by one factor (:func:`clip_local_gradients_by_norm_`); anywhere else it is the plugin's own.
    Clipping by value is elementwise and stays local."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        compressed = optimizer_with_local_gradients(optimizer)
        if compressed is None:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
            return
        shard_group = compressed.shards.shard_group if compressed.shards else None
        clip_local_gradients_by_norm_(self.main_params(optimizer), clip_val,  # type: ignore[attr-defined]
                                      compressed.process_group, shard_group)


class AgreedClippingPrecision(AgreedClipping, Precision):
    """``Precision`` ("32-true") with one clip factor for every rank where gradients are local."""


class AgreedClippingMixedPrecision(AgreedClipping, MixedPrecision):
    """``MixedPrecision`` ("16-mixed", "bf16-mixed") with one clip factor for every rank where gradients are local."""


def agreed_clipping_precision(plugin: Any) -> Any:
    """``plugin`` as its agreed-clipping counterpart where one exists (Lightning's plain ``Precision`` and
    ``MixedPrecision``, what ``"32-true"``, ``"16-mixed"`` and ``"bf16-mixed"`` make); any other plugin unchanged
    (it clips each rank's gradient by its own norm where gradients are local)."""
    if type(plugin) is Precision:
        return AgreedClippingPrecision()
    if type(plugin) is MixedPrecision:
        return AgreedClippingMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    return plugin
