"""Momentum masks and dead coordinates.

A momentum mask (param-group option ``exp_avg_mask``, DeepSpeed's semantics) holds 0 where a coordinate is frozen and
1 where it trains; it multiplies the averaged momentum every compressed step. Dead coordinates are those whose
gradient stayed exactly zero in every warmup step: their variance is zero, and 1-bit compression cannot send zero, so
from the first compressed step they would receive ``+-scale`` momentum and their updates explode unless masked.
:class:`DeadCoordinateTracker` finds them; the optimizer warns about the ones no mask covers
(:func:`report_dead_coordinates`), and :class:`~lightning_onebit.MomentumMask` (``auto=True``) turns them into masks.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from lightning_onebit._docs import docs_pointer


class DeadCoordinateTracker:
    """Which coordinates had a nonzero gradient in any tracked step: one bool tensor per tracked key (a parameter's
    ``id`` in the optimizer, its name in :class:`~lightning_onebit.MomentumMask`), allocated at the first gradient.

    Attributes:
        seen: key -> bool tensor of the parameter's shape, ``True`` where a tracked gradient was nonzero.
        since: the first tracked step (``None`` until one is tracked).
    """

    def __init__(self) -> None:
        self.seen: dict[Hashable, torch.Tensor] = {}
        self.since: Optional[int] = None

    def track(self, key: Hashable, grad: torch.Tensor, step: Optional[int] = None) -> None:
        """Record where ``grad`` is nonzero (on its device; no host synchronisation)."""
        if self.since is None:
            self.since = step
        seen = self.seen.get(key)
        if seen is None:
            self.seen[key] = grad != 0
        else:
            seen.logical_or_(grad != 0)

    def dead(self, key: Hashable, like: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``True`` where ``key``'s gradient was zero in every tracked step and ``mask`` (if any) does not already
        freeze the coordinate; ``None`` if ``key`` was not tracked or its shape is no longer ``like``'s."""
        seen = self.seen.get(key)
        if seen is None or seen.shape != like.shape:
            return None
        dead = ~seen
        if mask is not None:
            dead &= mask.to(dead.device) != 0
        return dead

    def clear(self) -> None:
        self.seen, self.since = {}, None

    def __bool__(self) -> bool:
        return bool(self.seen)


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


def mask_like(masks: list[Optional[torch.Tensor]], index: int, like: torch.Tensor) -> torch.Tensor:
    """The mask on ``like``'s device and dtype, converted once and cached in the group's mask list."""
    mask = masks[index]
    if mask.device != like.device or mask.dtype != like.dtype:
        mask = masks[index] = mask.to(device=like.device, dtype=like.dtype)
    return mask


def apply_momentum_masks_(groups: Sequence[dict[str, Any]], state: Any) -> None:
    """Multiply the (averaged) momentum ``state[p]["exp_avg"]`` of every trainable parameter of the compressed param
    groups by its mask, where it has one. ``compress=False`` groups are masked in their own update, after their
    gradient is folded in."""
    for group in groups:
        if not group["compress"]:
            continue
        masks = group["exp_avg_mask"]
        for i, p in enumerate(group["params"]):
            if p.requires_grad and masks[i] is not None:
                m = state[p]["exp_avg"]
                m.mul_(mask_like(masks, i, m))

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


def report_dead_coordinates(
    tracker: DeadCoordinateTracker,
    groups: Sequence[dict[str, Any]],
    owner: str,
    step: int,
    rank: Callable[[], int],
) -> None:
    """At the first compressed step of the optimizer class ``owner`` (masks are in place by then, ``step`` is its
    global step): warn on rank 0 (``rank()``) about trainable coordinates of the compressed param groups whose gradient
    was exactly zero in every warmup step ``tracker`` tracked (by ``id(param)``) and that no mask covers.

    Called from the optimizer's ``_average_momenta_``: ``stacklevel=4`` points the warning at the caller of ``step``.
    """
    since = tracker.since
    found, total = [], 0
    for g, group in enumerate(groups):
        if not group["compress"]:  # averaged in full precision: a zero gradient stays an exact zero
            continue
        for i, p in enumerate(group["params"]):
            dead = tracker.dead(id(p), p, group["exp_avg_mask"][i]) if p.requires_grad else None
            if dead is None:
                continue
            count = int(dead.sum())
            if count:
                found.append(f"{describe_param(group, g, i, p)}: {count} of {p.numel()}")
                total += count
    if not found or rank() != 0:
        return
    tracked = f" (steps {since}..{step - 1}" if since is not None else ""
    if since is not None:
        tracked += f"; steps before {since} ran before a resume and were not observed)" if since > 1 else ")"
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    warnings.warn(
        f"{owner}: {total} coordinate(s) in {len(found)} parameter(s) had an exactly-zero gradient "
        f"in every warmup step{tracked} and are not masked: {'; '.join(found[:3])}{more}. Their compressed updates can "
        "explode. Fix: MomentumMask(auto=True), or to train them a \"compress\": False param group; "
        f"warn_dead_coordinates=False silences this; {docs_pointer('guides/freeze-step', 'embedding-tables')}",
        UserWarning,
        stacklevel=4,
    )
