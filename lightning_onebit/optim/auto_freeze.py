"""``freeze_step="auto"``: end the warmup when the variance has stopped moving, decided by every rank together.

The rule (REFERENCE.md 3.3): every ``check_every`` warmup steps, compare ``sqrt(v)`` (bias-corrected where the update
corrects it, i.e. what the compression stage will use) with its value ``window`` steps earlier, on a fixed random
sample of coordinates and on every tensor's L1 norm::

    r = sum |s_t - s_{t-W}| / sum s_{t-W}                       (the coordinate sample)
    q = max over tensors of | ||s_t||_1 - ||s_{t-W}||_1 | / ||s_{t-W}||_1   (small tensors count as much as large)

The ranks take the maximum of each figure with one ``all_reduce`` of a few floats, so every rank sees the same
figures and decides the same step. The warmup ends after the check where both (and, for 1-bit LAMB, the relative
change of its trust-ratio EMA) have stayed below ``threshold`` for ``patience`` checks in a row, not before
``min_step``, and at ``max_step`` at the latest.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_onebit.optim.base import CompressedOptimizer


@dataclasses.dataclass
class AutoFreeze:
    """How ``freeze_step="auto"`` decides the end of the warmup. Every field is optional.

    Args:
        window: ``W``, the distance in optimizer steps between the two variance estimates compared. Default
            ``None``: ``round(1 / (1 - beta2))`` of the first param group (1000 for 0.999), the time constant of the
            variance's moving average. Shorter runs want a shorter window (the example uses 40).
        check_every: optimizer steps between checks; the window must be a multiple of it. Default ``None``: ``W / 4``
            (rounded so that it divides ``W``).
        threshold: the largest relative change (of the sample and of every tensor norm) that counts as settled.
            Default ``0.05``.
        patience: consecutive settled checks needed. Default ``3``.
        min_step: never end the warmup before this step. Default ``None``: the first full window (``W``).
        max_step: end the warmup at this step at the latest. Default ``None``: under the Lightning strategy 25% of
            ``trainer.estimated_stepping_batches``; without it a number is required (checked at the first step).
        sample_size: coordinates in the fixed random sample (the same on every rank). Default ``2**20``.
        seed: seed of the sample. Default ``0``.

    Cost while measuring: ``W / check_every + 1`` snapshots of ``sample_size + number of tensors`` floats (about
    20 MiB with the defaults), one pass over the variance per check and one ``all_reduce`` of 3 floats per check
    (from the first full window on). All of it is freed when the warmup ends.
    """

    window: Optional[int] = None
    check_every: Optional[int] = None
    threshold: float = 0.05
    patience: int = 3
    min_step: Optional[int] = None
    max_step: Optional[int] = None
    sample_size: int = 2**20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "check_every", "min_step", "max_step"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"AutoFreeze {name} must be an integer >= 1 or None, got {value!r}")
        for name in ("patience", "sample_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AutoFreeze {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (
            0 < self.threshold < math.inf
        ):
            raise ValueError(f"AutoFreeze threshold must be a number > 0, got {self.threshold!r}")
        if self.window is not None and self.check_every is not None and self.window % self.check_every:
            raise ValueError(
                f"AutoFreeze window ({self.window}) must be a multiple of check_every ({self.check_every})"
            )
        if self.min_step is not None and self.max_step is not None and self.min_step > self.max_step:
            raise ValueError(f"AutoFreeze min_step ({self.min_step}) is after max_step ({self.max_step})")


class FreezeDetector:
    """The measuring state of :class:`AutoFreeze` for one optimizer (snapshots, streak, last figures)."""

    def __init__(self, config: AutoFreeze, beta2: float) -> None:
        self.config = config
        self.window = config.window or max(1, round(1 / (1 - beta2)))
        every = config.check_every or max(1, self.window // 4)
        while self.window % every:  # the largest divisor of the window not above W / 4
            every -= 1
        self.check_every = every
        self.min_step = config.min_step or self.window
        self.max_step = config.max_step
        self.streak = 0
        self.seconds = 0.0  # wall time spent measuring and agreeing (this process)
        self.last: Optional[dict[str, Any]] = None  # figures of the latest comparison
        self.reason: Optional[str] = None  # why the warmup ended, once it has
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._sample: Optional[list[tuple[int, torch.Tensor]]] = None  # (parameter index, flat indices)

    # ------------------------------------------------------------------ the decision
    def observe(self, optimizer: "CompressedOptimizer", t: int) -> Optional[int]:
        """Called after warmup step ``t`` on every rank; returns ``t`` when the warmup ends with it, else ``None``.
        A collective at check steps from the first full window on (every rank calls it at the same steps)."""
        if self.max_step is None:
            raise ValueError(
                f"{type(optimizer).__name__}(freeze_step='auto') needs AutoFreeze(max_step=...) outside the Lightning "
                "strategy (which defaults it to 25% of the run): the latest step at which to end the warmup"
            )
        started = time.perf_counter()
        decided = None
        if t % self.check_every == 0:
            snapshot = self._snapshot(optimizer)
            self._snapshots[t] = snapshot
            for old_step in [s for s in self._snapshots if s < t - self.window]:
                del self._snapshots[old_step]
            old = self._snapshots.get(t - self.window)
            if old is not None:
                figures = _agree_max(_changes(old, snapshot), optimizer.process_group, optimizer._detector_device())
                r, q, coeff = figures
                settled = max(figures) < self.config.threshold
                self.streak = self.streak + 1 if settled else 0
                self.last = dict(step=t, sample_change=r, norm_change=q, coeff_change=coeff, streak=self.streak)
                if self.streak >= self.config.patience and t >= self.min_step:
                    decided, self.reason = t, "settled"
        if decided is None and t >= self.max_step:
            decided, self.reason = t, "max_step"
        if decided is not None:
            self._snapshots, self._sample = {}, None  # freed: nothing more to measure
        self.seconds += time.perf_counter() - started
        return decided

    def describe(self) -> str:
        """The figures behind the decision, for logs and the stage announcement."""
        last = self.last
        figures = (
            "no comparison yet"
            if last is None
            else (
                f"relative change of sqrt(v) over {self.window} steps at step {last['step']}: sample "
                f"{last['sample_change']:.3g}, largest tensor norm {last['norm_change']:.3g}"
                + (f", trust ratio {last['coeff_change']:.3g}" if last["coeff_change"] > 0 else "")
                + f"; {last['streak']} check(s) in a row below {self.config.threshold:g}"
            )
        )
        if self.reason == "max_step":
            return f"max_step {self.max_step} reached ({figures})"
        return figures

    # ------------------------------------------------------------------ measurements
    def _snapshot(self, optimizer: "CompressedOptimizer") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sample of sqrt(v_hat), L1 norm of sqrt(v_hat) per tensor, the optimizer's extra settling figures)``,
        in float64 on the CPU."""
        params = optimizer._detector_params()
        if self._sample is None:
            self._sample = _draw_sample([p.numel() for p, _, _ in params], self.config.sample_size, self.config.seed)
        # sqrt(v / c) = sqrt(v) / sqrt(c): one tensor's sqrt at a time, never a corrected copy of all of v
        norms = [0.0 if v is None else float(v.sqrt().double().sum()) / math.sqrt(c) for _, v, c in params]
        sample = []
        for i, idx in self._sample:
            _, v, c = params[i]
            if v is None:
                sample.append(torch.zeros(len(idx), dtype=torch.float64))
            else:
                sample.append(v.reshape(-1)[idx.to(v.device)].double().cpu().sqrt() / math.sqrt(c))
        extra = optimizer._settling_figures()
        return (
            torch.cat(sample) if sample else torch.zeros(0, dtype=torch.float64),
            torch.tensor(norms, dtype=torch.float64),
            torch.zeros(0, dtype=torch.float64) if extra is None else extra.double().cpu(),
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return dict(streak=self.streak, last=self.last, snapshots={k: list(v) for k, v in self._snapshots.items()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict: start measuring afresh)."""
        self.streak = int(state.get("streak", 0))
        self.last = state.get("last")
        self._snapshots = {int(k): tuple(v) for k, v in (state.get("snapshots") or {}).items()}
        self._sample = None  # drawn again from the seed: the same coordinates


def _draw_sample(numels: list[int], size: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    """``size`` distinct coordinates drawn uniformly over all tensors (all if there are fewer), the same on every
    rank: ``(tensor index, flat indices)`` pairs."""
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


def _relative_change(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Elementwise ``|new - old| / old``; 0 where both are 0, 1 where only ``old`` is (it just started moving)."""
    change = (new - old).abs() / old.clamp_min(1e-300)
    return torch.where(old > 0, change, (new > 0).double())


def _changes(old: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> list[float]:
    """``[r, q, coeff]``: the sample's relative L1 change, the largest relative change of a tensor norm, the largest
    relative change of the extra figures (0 without them)."""
    (sample_old, norms_old, extra_old), (sample_new, norms_new, extra_new) = old, new
    base = float(sample_old.sum())
    r = float((sample_new - sample_old).abs().sum()) / base if base > 0 else (1.0 if float(sample_new.sum()) else 0.0)
    q = float(_relative_change(norms_old, norms_new).max()) if norms_old.numel() else 0.0
    coeff = float(_relative_change(extra_old, extra_new).max()) if extra_old.numel() == extra_new.numel() > 0 else 0.0
    return [r, q, coeff]


def _agree_max(values: list[float], group: Any, device: torch.device) -> list[float]:
    """Every rank's figures replaced by their maximum over the group (one all_reduce of a few floats, on the
    parameters' device: NCCL takes CUDA tensors only)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
