"""The measurements behind ``freeze_step="auto"``: the fixed coordinate sample, the variance read to the host in one
copy per device, the backtest excesses of a window's gradients over a variance frozen a window earlier, and the
ranks' agreement on the figures. They keep no state: :class:`~lightning_onebit.optim.auto_freeze.FreezeDetector` keeps
it and decides.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_onebit.comm.agreement import agree
from lightning_onebit.comm.groups import group_size

# A tensor whose variance per element is below this fraction of the median tensor's carries numerical noise only
# (e.g. attention key biases, whose gradient is zero in exact arithmetic): its relative figures are left out.
_NEGLIGIBLE_VARIANCE = 1e-8


def draw_sample(numels: list[int], size: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    """``size`` distinct coordinates drawn uniformly over all tensors (all if there are fewer), the same on every
    rank: ``(tensor index, flat indices)`` pairs, in tensor order."""
    total = sum(numels)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(total, generator=generator)[:size].sort().values if total > size else torch.arange(total)
    out, start = [], 0
    for i, n in enumerate(numels):
        lo, hi = torch.searchsorted(chosen, torch.tensor([start, start + n])).tolist()
        if hi > lo:
            out.append((i, chosen[lo:hi] - start))
        start += n
    return out


def read_on_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each (1-D float64) tensor's values in CPU memory, with one copy per device: a device's tensors are concatenated
    there and copied at once (the one host synchronisation), then split on the CPU."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor] = [torch.zeros(0)] * len(tensors)
    for device, indices in by_device.items():
        joined = torch.cat([tensors[i] for i in indices]).cpu()
        for i, piece in zip(indices, joined.split([tensors[i].numel() for i in indices])):
            out[i] = piece
    return out


def _window_moment(v_new: torch.Tensor, v_old: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``E = (v_t - a v_{t-W}) / (1 - a)``: the (exponentially weighted) mean squared gradient of the window."""
    return (v_new - decay * v_old).div_(1 - decay).clamp_min_(0)


def excesses(
    old: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...], decays: list[tuple[float, float]],
    sample_counts: torch.Tensor, numels: list[int],
) -> list[float]:
    """``[e, e_T, coeff_mean, coeff_max]``: the sample's excess, the largest tensor excess, and the relative change of
    the extra figures (one per tensor; 0 without them) averaged over the coordinates (each tensor weighted by its
    ``numels``) and at its largest. ``decays``: ``(beta2^W, bias correction now)`` per tensor; ``sample_counts``: the
    sample's coordinates in each tensor (they lie tensor by tensor)."""
    (sample_old, sums_old, extra_old), (sample_new, sums_new, extra_new) = old, new
    decay = torch.tensor([d for d, _ in decays], dtype=torch.float64)
    # the bias correction a window ago: 1 - b2^(t-W) = 1 - (1 - c_t) / b2^W (1 without bias correction)
    correction = 1 - (1 - torch.tensor([c for _, c in decays], dtype=torch.float64)) / decay
    # per tensor
    moment = _window_moment(sums_new, sums_old, decay)
    frozen = sums_old / correction
    live = frozen > 0
    if live.any():
        live &= frozen >= _NEGLIGIBLE_VARIANCE * frozen[live].median()
    ratio = torch.where(live, moment / frozen.clamp_min(1e-300), torch.zeros_like(frozen))
    tensor = float((ratio.sqrt() - 1).clamp_min(0).max()) if ratio.numel() else 0.0
    # the sample: its coordinates lie tensor by tensor, in the order of draw_sample
    if sample_new.numel():
        if bool((decay == decay[0]).all() and (correction == correction[0]).all()):
            # one beta2 and one step for every tensor (the usual case): scalars, not a per-coordinate expansion
            d, c = decay[0], correction[0]
        else:
            d, c = decay.repeat_interleave(sample_counts), correction.repeat_interleave(sample_counts)
        root_frozen = (sample_old / c).sqrt_()
        excess = _window_moment(sample_new, sample_old, d).sqrt_().sub_(root_frozen).clamp_min_(0)
        base = float(root_frozen.sum())
        sample = float(excess.sum()) / base if base > 0 else (1.0 if float(excess.sum()) > 0 else 0.0)
    else:
        sample = 0.0
    coeff_mean = coeff_max = 0.0
    if extra_old.numel() == extra_new.numel() > 0:
        if extra_new.numel() != len(numels):
            raise ValueError(
                f"the optimizer's settling figures have {extra_new.numel()} values for {len(numels)} measured tensors: "
                "_settling_figures must return one per tensor"
            )
        change = (extra_new - extra_old).abs() / extra_old.clamp_min(1e-300)
        change = torch.where(extra_old > 0, change, (extra_new > 0).double())
        weights = torch.tensor(numels, dtype=torch.float64)
        coeff_mean = float((change * weights).sum() / weights.sum())
        coeff_max = float(change.max())
    return [sample, tensor, coeff_mean, coeff_max]


def agree_max(values: list[float], group: Any, device: torch.device) -> list[float]:
    """Every rank's figures replaced by their maximum over the group (:func:`~lightning_onebit.comm.agreement.agree`:
    one all_reduce of a few floats, on the parameters' device: NCCL takes CUDA tensors only)."""
    if group_size(group) == 1:
        return values
    return agree(torch.tensor(values, dtype=torch.float64, device=device), group, reduce="max").tolist()
