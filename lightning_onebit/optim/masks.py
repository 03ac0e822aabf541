"""Momentum masks and dead coordinates.

A momentum mask (param-group option ``exp_avg_mask``, DeepSpeed's semantics) holds 0 where a coordinate is frozen and
1 where it trains; it multiplies the averaged momentum every compressed step. Dead coordinates are those whose
gradient stayed exactly zero in every warmup step: their variance is zero, and 1-bit compression cannot send zero, so
from the first compressed step they would receive ``+-scale`` momentum and their updates would explode unmasked.
:func:`zero_variance_coordinates` finds them from the frozen variance (``v == 0``) at the first compressed step, and
the optimizer keeps them at rest by default (``dead_coordinates="mask"``,
:func:`~lightning_onebit.optim.functional.mask_`).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Sequence

import torch

from lightning_onebit._docs import docs_pointer

#: What the Adam-family optimizers do with dead coordinates at the first compressed step (``dead_coordinates``).
DeadCoordinates = Literal["mask", "warn", "ignore"]


def describe_param(group: dict[str, Any], group_index: int, index: int, param: torch.Tensor) -> str:
    """How errors and warnings name a parameter: ``'emb.weight' (param group 0, index 3, shape (20, 8))`` when the
    optimizer was given ``named_parameters()``, else ``parameter 3 of param group 0 (shape (20, 8))``."""
    names = group.get("param_names")
    if names and index < len(names):
        return f"{names[index]!r} (param group {group_index}, index {index}, shape {tuple(param.shape)})"
    return f"parameter {index} of param group {group_index} (shape {tuple(param.shape)})"


def check_exp_avg_mask(mask: Any, param: torch.Tensor, what: str) -> torch.Tensor:
    """Check a momentum mask for ``param`` and return it on the parameter's device and dtype.

    A mask must be a tensor of exactly the parameter's shape, bool or floating point, with only the values 0 and 1
    (finite). ``what`` names the mask in the ``ValueError`` (e.g. ``"exp_avg_mask[1] of param group 0"``). Used by
    :class:`~lightning_onebit.OnebitAdam` and :class:`~lightning_onebit.MomentumMask`.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(mask).__name__}")
    if mask.shape != param.shape:
        raise ValueError(
            f"{what} has shape {tuple(mask.shape)} but its parameter has shape {tuple(param.shape)}; "
            "a mask must have exactly the parameter's shape"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"{what} has dtype {mask.dtype}; a mask is a bool or floating-point tensor of 0s and 1s "
            "(convert it with `mask.bool()`)"
        )
    if mask.device.type == "meta":
        raise ValueError(f"{what} is on the meta device (it has no values); create it on a real device")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)  # NaN and +-inf included
        if bool(bad.any()):
            example = float(mask[bad].flatten()[0])
            raise ValueError(
                f"{what} has {int(bad.sum())} value(s) other than 0 and 1 (e.g. {example}); a momentum mask, which "
                "multiplies the momentum every compressed step, holds only 0 (frozen) and 1 (trained): use e.g. "
                "`(mask != 0).float()`"
            )
    return mask.to(device=param.device, dtype=param.dtype)


def normalise_masks(mask: Any, group: dict[str, Any], group_index: int) -> list[Optional[torch.Tensor]]:
    """One mask (or None) per parameter of the group, each checked by :func:`check_exp_avg_mask`."""
    params = group["params"]
    if mask is None:
        return [None] * len(params)
    where = f"of param group {group_index}"
    if isinstance(mask, torch.Tensor):
        masks: list[Any] = [mask] * len(params)
        names = [f"exp_avg_mask {where} (group-wide, for its parameter {i})" for i in range(len(params))]
    elif isinstance(mask, (list, tuple)):
        masks = list(mask)
        if len(masks) != len(params):
            raise ValueError(
                f"exp_avg_mask {where} has {len(masks)} entries but the group has {len(params)} parameters; give one "
                "tensor or None per parameter"
            )
        names = [f"exp_avg_mask[{i}] {where}" for i in range(len(params))]
    else:
        raise ValueError(
            f"exp_avg_mask {where} must be a tensor, a list of tensors/None, or None; got {type(mask).__name__}"
        )
    return [None if m is None else check_exp_avg_mask(m, p, what) for m, p, what in zip(masks, params, names)]


def set_exp_avg_mask(
    groups: Sequence[dict[str, Any]], param: torch.Tensor, mask: Optional[torch.Tensor], owner: str
) -> None:
    """Set (or with ``None`` clear) the momentum mask of ``param`` in the param groups ``groups`` of the optimizer
    class ``owner``: the mask is checked (:func:`check_exp_avg_mask`) and converted to the parameter's dtype and
    device. Raises ``ValueError`` naming the parameter if the mask is invalid or no group holds ``param``."""
    for g, group in enumerate(groups):
        for index, p in enumerate(group["params"]):
            if p is param:
                if mask is not None:
                    what = f"set_exp_avg_mask: the mask for {describe_param(group, g, index, p)}"
                    mask = check_exp_avg_mask(mask, p, what)
                group["exp_avg_mask"][index] = mask
                return
    shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
    raise ValueError(
        f"set_exp_avg_mask: the parameter of shape {shape} is not managed by this optimizer (it is in none of its "
        f"{len(groups)} param group(s)); pass it to {owner} (or add_param_group) or drop its mask"
    )


def zero_variance_coordinates(
    groups: Sequence[dict[str, Any]], state: Any
) -> tuple[dict[int, torch.Tensor], list[tuple[str, int, int]]]:
    """The dead coordinates of the compressed param groups once their variance is frozen: ``v == 0`` (no warmup step
    gave them a nonzero averaged gradient), where no ``exp_avg_mask`` already masks them.

    Returns ``{id(param): bool tensor}`` for the parameters that have any, and ``(name, count, numel)`` for each of
    them (:func:`describe_param`'s name). One host synchronisation per device for all the counts; called once, at the
    first compressed step after construction or a load."""
    found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for g, group in enumerate(groups):
        if not group["compress"]:  # averaged in full precision: a zero gradient stays an exact zero
            continue
        for i, p in enumerate(group["params"]):
            if not p.requires_grad or p not in state or "exp_avg_sq" not in state[p]:
                continue  # never had a gradient: frozen whole (MomentumBuckets.frozen)
            zero = state[p]["exp_avg_sq"] == 0
            mask = group["exp_avg_mask"][i]
            if mask is not None:
                zero &= mask.to(zero.device) != 0
            found.append((describe_param(group, g, i, p), p, zero))
    counts: dict[int, int] = {}
    for device in {zero.device for _, _, zero in found}:
        on_device = [(k, zero) for k, (_, _, zero) in enumerate(found) if zero.device == device]
        sums = torch.stack([zero.sum() for _, zero in on_device]).tolist()
        counts.update({k: int(n) for (k, _), n in zip(on_device, sums)})
    masks = {id(p): zero for k, (_, p, zero) in enumerate(found) if counts[k]}
    report = [(name, counts[k], p.numel()) for k, (name, p, _) in enumerate(found) if counts[k]]
    return masks, report


class DeadCoordinateMasks:
    """The masks part of a compressed optimizer: its ``dead_coordinates`` policy (``"mask"``, ``"warn"`` or
    ``"ignore"``), the dead coordinates it keeps at rest (:attr:`kept`: ``{id(param): v == 0}``, found at the first
    compressed step after construction or a load, ``None`` until then), and the callback that masks and reports them
    itself, if any (:attr:`masked_by`: then the optimizer does not warn)."""

    def __init__(self, policy: DeadCoordinates, owner: str) -> None:
        self.policy, self.owner = policy, owner
        self.kept: Optional[dict[int, torch.Tensor]] = None
        self.masked_by: Optional[str] = None

    def find(self, groups: Sequence[dict[str, Any]], state: Any, rank: int) -> dict[int, torch.Tensor]:
        """:attr:`kept`, found now if not yet (:func:`dead_coordinates_to_keep`; reported on rank 0 unless a
        callback masks them)."""
        if self.kept is None:
            self.kept = dead_coordinates_to_keep(groups, state, self.policy, self.owner,
                                                 report=self.masked_by is None and rank == 0)
        return self.kept


def dead_coordinates_to_keep(groups: Sequence[dict[str, Any]], state: Any, policy: DeadCoordinates, owner: str,
                             report: bool) -> dict[int, torch.Tensor]:
    """The dead coordinates the optimizer class ``owner`` keeps at rest from its first compressed step on, by its
    ``dead_coordinates`` ``policy``: ``{id(param): v == 0}`` with ``"mask"`` (:func:`zero_variance_coordinates`),
    nothing with ``"warn"`` or ``"ignore"``; reported (:func:`warn_zero_variance`) if ``report`` (rank 0, and no
    callback masks them itself), unless ``"ignore"``."""
    if policy == "ignore":
        return {}
    zero_variance, found = zero_variance_coordinates(groups, state)
    if found and report:
        warn_zero_variance(found, owner, policy == "mask")
    return zero_variance if policy == "mask" else {}


def warn_zero_variance(report: Sequence[tuple[str, int, int]], owner: str, masked: bool) -> None:
    """Say, in two lines, how many dead coordinates :func:`zero_variance_coordinates` found and what happens to them:
    kept at rest (``masked``), or free to take the updates 1-bit noise gives them (up to ``lr * B`` a step under
    ``cap_update``, about ``lr * scale / eps`` without).

    Called from :func:`dead_coordinates_to_keep` at the first compressed step (by the optimizer's
    ``_begin_exchange``, through :meth:`DeadCoordinateMasks.find`): ``stacklevel=5`` points the warning at the
    algorithm's compressed step."""
    total = sum(count for _, count, _ in report)
    name, count, numel = report[0]
    more = f" and {len(report) - 1} more parameter(s)" if len(report) > 1 else ""
    fate = (
        "stay at rest; to train them, use a \"compress\": False param group"
        if masked
        else "are not masked (dead_coordinates='warn'): 1-bit noise moves them every step (without cap_update, "
        "by about lr * scale / eps)"
    )
    warnings.warn(
        f"{owner}: {total} coordinate(s) had no gradient in warmup ({name}: {count} of {numel}{more}) and {fate}. "
        f"{docs_pointer('guides/freeze-step', 'embedding-tables')}",
        UserWarning,
        stacklevel=5,
    )
