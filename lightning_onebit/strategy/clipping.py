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
of ``||g||`` that one all-reduce of 257 numbers agrees (:func:`estimate_mean_gradient_norm`: a random-sign sketch of
the mean gradient, capped by ``sqrt(mean_r ||g_r||^2)``). Since every fold the optimizer then averages is linear in
the gradient, the average of the clipped local gradients is ``factor * g``: DDP's clipped gradient, up to the
estimate's error (a few percent). Elsewhere (warmup, variance steps) they are Lightning's, bit for bit.
``python -m benchmarks.clipping`` measured the rules against DDP on Lightning's transformer demo
(``docs/guides/configuration.md#gradient-clipping``).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_onebit.comm.groups import group_size
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.optim.sharded import is_sharded

__all__ = [
    "AgreedClipping",
    "AgreedClippingMixedPrecision",
    "AgreedClippingPrecision",
    "agreed_clipping_precision",
    "SKETCH_BINS",
    "clip_local_gradients_by_norm_",
    "estimate_mean_gradient_norm",
    "gradient_sketch",
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
    if group_size(inner.process_group) < 2:
        return None
    return inner


#: The random-sign sums each rank all-reduces, with its squared norm, to estimate the norm of the averaged gradient
#: (:func:`estimate_mean_gradient_norm`): 1 KB in float32, a latency-bound message like one number.
SKETCH_BINS = 256
_CHUNK_ELEMENTS = 1 << 22  # elements sketched at a time: bounds the temporaries (about 9 bytes an element)
_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the chunks' seeds (any odd 64-bit constant would do)
_LOW_BIT_OF_EACH_BYTE = 0x0101010101010101


def _flat_chunks(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The elements of ``tensors`` in order, as lists of flat pieces of at most ``_CHUNK_ELEMENTS`` elements in all;
    the same cut wherever the tensors have the same shapes."""
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        for piece in tensor.reshape(-1).split(_CHUNK_ELEMENTS):
            if chunk and size + piece.numel() > _CHUNK_ELEMENTS:
                yield chunk
                chunk, size = [], 0
            chunk.append(piece)
            size += piece.numel()
    if chunk:
        yield chunk


def gradient_sketch(tensors: list[torch.Tensor], seed: int, bins: int = SKETCH_BINS) -> torch.Tensor:
    """Random-sign sums of the elements of ``tensors``: a float32 vector of ``bins`` on the first tensor's device.

    Element ``j`` of each chunk of the tensors' elements (in order, :data:`_CHUNK_ELEMENTS` at a time) is added to bin
    ``j mod bins`` times a random sign, drawn from a generator seeded by ``seed`` and the chunk's index. The sketch is
    linear in the tensors, so ranks that use the same ``seed`` for tensors of the same shapes sketch their mean by the
    mean of their sketches. Its squared norm is an unbiased estimate of the tensors' squared norm (the cross terms of
    two elements in one bin have random signs), exact where no bin holds two nonzero elements, with a relative
    standard deviation of at most ``sqrt(2 / bins)`` when no few bins hold most of the norm (9% for 256 bins, 4% on
    the norm). ``bins`` must be a multiple of 8. A few kernels per chunk, no host synchronisation."""
    device = tensors[0].device
    sums = torch.zeros(bins, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    for index, chunk in enumerate(_flat_chunks(tensors)):
        pieces = [piece.to(device=device, dtype=torch.float32) for piece in chunk]  # no copy for float32 on device
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if flat.numel() % bins:
            flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % bins))
        flat = flat.view(-1, bins)
        generator.manual_seed((seed + index * _SEED_STRIDE) % 2**63)
        # one random bit per element, 64 drawn at a time (the low bit of each byte of a random int64, all of them
        # uniform): drawing them one by one costs several times more on CPU
        words = torch.empty(flat.numel() // 8, dtype=torch.int64, device=device).random_(generator=generator)
        bits = words.bitwise_and_(_LOW_BIT_OF_EACH_BYTE).view(torch.uint8).view(-1, bins)
        # sum of +-x = 2 * (sum of the elements with bit 1) - (sum of all)
        sums += (flat * bits).sum(0).mul_(2).sub_(flat.sum(0))
    return sums


def _local_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of the elements of ``grads``, as a float32 scalar on the first gradient's device: one
    ``_foreach_norm`` per device and dtype, as ``clip_grad_norm_`` takes them; no host synchronisation."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    norms = [n.to(device=device, dtype=torch.float32) for group in by_kind.values() for n in torch._foreach_norm(group)]
    return torch.stack(norms).square().sum()


def estimate_mean_gradient_norm(
    grads: list[torch.Tensor], group: Optional[dist.ProcessGroup], seed: int,
    shard_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """An estimate of ``||mean_r g_r||``, the norm of the gradient averaged over the ranks ``r`` of ``group`` (each
    rank passes its own ``grads``, of the same shapes on every rank), the same float32 scalar on every rank, from one
    all-reduce over ``group`` of :data:`SKETCH_BINS` + 1 numbers: this rank's :func:`gradient_sketch` (with ``seed``,
    the same on every rank of ``group``) and its squared norm. The estimate is the smaller of

    * the norm of the mean sketch, the sketch of the mean gradient: its square estimates ``||mean_r g_r||^2`` without
      bias (exactly for a gradient of at most :data:`SKETCH_BINS` elements);
    * ``sqrt(mean_r ||g_r||^2)``, an upper bound: ``mean_r ||g_r||^2 = ||mean_r g_r||^2 + mean_r ||g_r - mean_s
      g_s||^2``, above the truth by the spread of the ranks' gradients (their sampling noise, whose square averaging
      divides by ``P``).

    With ``shard_group`` (``DTensor`` gradients: each rank holds a shard of its replica's gradient) the local shards
    are sketched and their figures first summed over it (one all-reduce of the same size); ``seed`` must then differ
    between the ranks of ``shard_group`` (their shards' signs must be independent) and be the same along ``group``.
    A NaN or inf on one rank makes the estimate NaN or inf on every rank (as DDP's average would); the collectives
    are issued the same way whatever the values, so no rank waits for another."""
    local = [g.to_local() if is_sharded(g) else g for g in grads]
    figures = torch.cat([gradient_sketch(local, seed), _local_squares(local).reshape(1)])
    if shard_group is not None:
        dist.all_reduce(figures, group=shard_group)
    dist.all_reduce(figures, group=group)
    figures.div_(dist.get_world_size(group))
    return torch.minimum(figures[:-1].square().sum(), figures[-1]).sqrt()


def clip_local_gradients_by_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, group: Optional[dist.ProcessGroup], seed: int,
    shard_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Scale every rank's gradients of ``parameters`` by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s
    factor) with ``norm`` = :func:`estimate_mean_gradient_norm` over ``group`` (and ``shard_group``) with ``seed``: the
    same factor on every rank, so the ranks' clipped gradients average to the mean gradient clipped by that norm. A
    collective: every rank of ``group`` calls it at the same point, with the same parameters in the same order. A
    parameter that requires a gradient but has none on this rank counts as zeros (so that the ranks' sketches stay
    aligned). Returns ``norm`` (a tensor on the gradients' device). No host synchronisation."""
    params = [p for p in parameters if p.requires_grad or p.grad is not None]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p.to_local() if is_sharded(p) else p) for p in params]
    if not grads:  # still join the collectives
        grads = [torch.zeros(0)]
    norm = estimate_mean_gradient_norm(grads, group, seed, shard_group)
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
        # new signs every step; under FSDP each shard of a node its own, the same on every node
        seed = compressed.step_count * 65_537 + (0 if shard_group is None else dist.get_rank(shard_group))
        clip_local_gradients_by_norm_(self.main_params(optimizer), clip_val,  # type: ignore[attr-defined]
                                      compressed.process_group, seed, shard_group)


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
